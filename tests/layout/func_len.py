#!/usr/bin/env python3
"""func_len.py - no product function over 150 lines, no product .c file over 1,200.

Usage: func_len.py SOURCE_DIR     check the product folders of a checkout
       func_len.py --self-test    check that the parser finds a synthetic long function

Product code is every .c and .cu file under proto/, service/, cache/, kernels/ and
transport/ (their tool subfolders included; tests/ is not product). The parser relies on
the repository's clang-format style (BreakBeforeBraces: Linux, the return type on its own
line): a function body opens with a `{` alone at column 0 and closes with the next `}`
alone at column 0. A function's length counts from the line holding its name (the first
`name(` of the declarator before the brace) to its closing brace, both included. A .c
file's length is its number of lines.

Exit 0 when every function and file is within its limit, 1 with one line per problem
(`path:line: function NAME is N lines (> 150)`), 2 on a usage error.
"""
import os
import re
import sys
import tempfile

MAX_FUNC_LINES = 150
MAX_FILE_LINES = 1200
# macro-like words that take parentheses in a declarator without naming the function
NOT_NAMES = {"__launch_bounds__", "__attribute__", "__declspec", "alignas", "_Alignas"}
NAME_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def product_files(root):
    """The product .c/.cu files: the docs test's list of source files (one copy of it)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"))
    from check_layout import source_files  # tests/docs/check_layout.py

    return [f for f in source_files(root) if f.endswith((".c", ".cu"))]


def functions(lines):
    """(name, first line, last line) of each function definition, 1-based."""
    found = []
    i = 0
    while i < len(lines):
        if lines[i].rstrip() != "{":
            i += 1
            continue
        # the declarator: lines above the brace up to a blank line, a statement, a
        # comment's end, a preprocessor line or a previous closing brace
        start = i
        while start > 0:
            prev = lines[start - 1].rstrip()
            if (not prev or prev.endswith((";", "*/", "}")) or prev.startswith("#")
                    or prev.lstrip().startswith(("//", "/*", "*"))):
                break
            start -= 1
        name, name_line = "?", start
        for k in range(start, i):
            m = next((m for m in NAME_RE.finditer(lines[k]) if m.group(1) not in NOT_NAMES),
                     None)
            if m:
                name, name_line = m.group(1), k
                break
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != "}":
            end += 1
        found.append((name, name_line + 1, end + 1))
        i = end + 1
    return found


def check(root):
    problems = []
    for rel in product_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if rel.endswith(".c") and len(lines) > MAX_FILE_LINES:
            problems.append("%s: file is %d lines (> %d)" % (rel, len(lines), MAX_FILE_LINES))
        for name, first, last in functions(lines):
            n = last - first + 1
            if n > MAX_FUNC_LINES:
                problems.append("%s:%d: function %s is %d lines (> %d)"
                                % (rel, first, name, n, MAX_FUNC_LINES))
    return problems


def self_test():
    """The parser on a synthetic tree: a function of exactly 150 lines (passes), one of
    151 (fails), a CUDA kernel whose name is on an indented line, and a .c file of 1,201
    lines (fails)."""
    body = ["    x++;"] * (MAX_FUNC_LINES - 4)
    ok = ["static int", "short_fn(int x)", "{"] + body + ["    return x;", "}"]
    long_ = ["int", "long_fn(int x,", "        int y)", "{"] + body + ["    return x + y;", "}"]
    cu = ["static __global__ void", "__launch_bounds__(256)", "    cu_kernel(const float *p)",
          "{"] + body + ["}"]
    a_c = ["/* a.c */", "#include <stdio.h>", ""] + ok + [""] + long_
    want_fns = [("short_fn", 5, 3 + len(ok)), ("long_fn", 6 + len(ok), len(a_c))]
    if functions(a_c) != want_fns or functions(cu) != [("cu_kernel", 3, len(cu))]:
        print("self-test: parsed %r and %r" % (functions(a_c), functions(cu)))
        return 1
    with tempfile.TemporaryDirectory() as root:
        for d in ("kernels", "service", "tests"):
            os.makedirs(os.path.join(root, d))
        files = {"kernels/a.c": a_c, "kernels/k.cu": cu, "tests/t.c": long_,
                 "service/big.c": ["int x;"] * (MAX_FILE_LINES + 1)}
        for rel, text in files.items():
            with open(os.path.join(root, rel), "w") as f:
                f.write("\n".join(text) + "\n")
        got = sorted(check(root))
        want = sorted([
            "kernels/a.c:%d: function long_fn is %d lines (> %d)"
            % (6 + len(ok), MAX_FUNC_LINES + 1, MAX_FUNC_LINES),
            "service/big.c: file is %d lines (> %d)" % (MAX_FILE_LINES + 1, MAX_FILE_LINES),
        ])
        if got != want:
            print("self-test: got %r, want %r" % (got, want))
            return 1
    print("self-test: ok (a 151-line function and a 1,201-line file fail, 150 lines pass)")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    problems = check(argv[1])
    for p in problems:
        print(p)
    if problems:
        print("%d problem(s): split the function or file along its seams (issue 24)"
              % len(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
