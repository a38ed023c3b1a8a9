#!/usr/bin/env python3
"""check_layout.py - docs/design.md's Layout section against the source tree.

Usage: check_layout.py SOURCE_DIR

The Layout section's code block lists folders (a line starting at column 0 with a
path, e.g. `cache/`) and, in each folder's lines, the files it holds. A file name is a
word ending in a source extension; it is relative to its folder (or to the repository
when that does not exist), and may use `*` to stand for a family (`page_avx*.c`);
`page.c/.h` names page.c and page.h. The
test fails when
  - a name in the Layout matches no file (a file that was renamed or removed), or
  - a source file of a top-level source folder (proto, service, cache, kernels,
    transport, recursively) is named nowhere in the Layout.
Source files: .c .h .cu .cuh .proto .py and the Markdown specifications in proto/.
Exit 0 when the Layout is true, 1 with one line per problem otherwise.
"""
import fnmatch
import os
import re
import subprocess
import sys

FOLDERS = ("proto", "service", "cache", "kernels", "transport")
SOURCE_EXT = (".c", ".h", ".cu", ".cuh", ".proto", ".py")
NAME_EXT = SOURCE_EXT + (".md", ".txt", ".sh", ".in", ".cmake", ".json", ".yaml")
NAME_RE = re.compile(r"[A-Za-z0-9_.*/+-]+(?:%s)\b" % "|".join(re.escape(e) for e in NAME_EXT))


def layout_block(design):
    """The lines of the code block under '## Layout'."""
    lines = open(design, encoding="utf-8").read().split("\n")
    try:
        start = lines.index("## Layout")
    except ValueError:
        sys.exit("docs/design.md: no '## Layout' section")
    block, inside = [], False
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("```"):
            if inside:
                return block
            inside = True
            continue
        if inside:
            block.append(line)
    sys.exit("docs/design.md: the Layout section has no code block")


def source_files(root):
    """Tracked source files of the top-level source folders (git ls-files, else a walk)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard", *FOLDERS],
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for folder in FOLDERS:
            for d, _, files in os.walk(os.path.join(root, folder)):
                out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    keep = []
    for f in out:
        if not os.path.exists(os.path.join(root, f)):
            continue  # deleted in the working tree
        if f.endswith(SOURCE_EXT) or (f.startswith("proto/") and f.endswith(".md")):
            keep.append(f)
    return sorted(set(keep))


def named(root, block):
    """(pattern, line) for every file the Layout names, patterns relative to the root."""
    out, folder = [], ""
    for line in block:
        m = re.match(r"^(\S+/)\s", line + " ")
        if m and not line.startswith(" "):
            folder = m.group(1)
        elif line and not line.startswith(" "):
            folder = ""  # a top-level file (CMakeLists.txt, README.md)
        # "page.c/.h" names page.c and page.h
        for word in NAME_RE.findall(re.sub(r"([\w*.-]+)\.c/\.h\b", r"\1.c \1.h", line)):
            if word.endswith("/"):
                continue
            cands = [os.path.normpath(os.path.join(folder, word))] if folder else []
            cands.append(os.path.normpath(word))
            hit = next((c for c in cands if glob_match(root, c)), cands[0])
            out.append((hit, line.strip()))
    return out


def glob_match(root, pattern):
    if "*" not in pattern:
        return os.path.exists(os.path.join(root, pattern))
    d = os.path.join(root, os.path.dirname(pattern))
    return os.path.isdir(d) and any(fnmatch.fnmatch(f, os.path.basename(pattern))
                                    for f in os.listdir(d))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    block = layout_block(os.path.join(root, "docs", "design.md"))
    names = named(root, block)
    problems = []
    for pattern, line in names:
        if not glob_match(root, pattern):
            problems.append("docs/design.md Layout names %s, which does not exist (line: %s)"
                            % (pattern, line))
    patterns = [p for p, _ in names]
    for f in source_files(root):
        if not any(fnmatch.fnmatch(f, p) for p in patterns):
            problems.append("docs/design.md Layout does not name %s" % f)
    for p in problems:
        print(p)
    if problems:
        print("%d problem(s); the Layout section of docs/design.md lists every source file "
              "of %s" % (len(problems), ", ".join(FOLDERS)))
        return 1
    print("Layout: %d names, every one exists; %d source files, every one named"
          % (len(names), len(source_files(root))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
