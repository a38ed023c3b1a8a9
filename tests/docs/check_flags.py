#!/usr/bin/env python3
"""check_flags.py - keeps the documentation true to the code and inside the repository.

  check_flags.py flags SOURCE_DIR TQKV_SERVER
      Runs `tqkv-server --help` and checks that every flag and TQKV_* variable it prints
      is a row of the flag table in docs/operations.md, with the same variable on the
      same row, and that every row of that table is a flag --help prints. Also: every
      TQKV_* variable the product code reads with getenv (kernels/, cache/, transport/,
      service/) is in docs/operations.md, and every variable of its "Other variables"
      table is still used by some file of the repository.

  check_flags.py links SOURCE_DIR
      Every relative link of every tracked Markdown file points to a file or folder that
      exists (and, for "FILE.md#anchor", to a heading of that file), and no tracked file
      refers to the project's shared folder outside the repository.

Exits 1 naming every problem found, 0 when there is none, 2 on bad arguments.
"""
import os
import re
import subprocess
import sys

FLAG_TABLE_DOC = os.path.join("docs", "operations.md")

# Built from pieces so that this file does not match itself.
OUTSIDE_REFS = ["../" + "shared", "shared/" + "design.md"]


def fail(problems):
    for p in problems:
        print("check_flags: " + p)
    print("check_flags: %d problem(s)" % len(problems))
    return 1


def help_options(server):
    """{flag: env or None} from `tqkv-server --help`."""
    out = subprocess.run([server, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=60, check=False)
    if out.returncode != 0:
        raise SystemExit("check_flags: %s --help exited %d:\n%s" %
                         (server, out.returncode, out.stdout.decode(errors="replace")))
    opts = {}
    for line in out.stdout.decode().splitlines():
        # Option lines: "  --name ARG   help text [TQKV_NAME]"
        m = re.match(r"^  (--[a-z0-9][a-z0-9-]*)\b.*?(?:\[(TQKV_[A-Z0-9_]+)\])?\s*$", line)
        if m and (m.group(1) not in opts or m.group(2)):
            opts[m.group(1)] = m.group(2)  # examples below the table repeat a flag
    # Every variable named anywhere in the option lines (a variable that lost its flag).
    return opts, set(re.findall(r"\[(TQKV_[A-Z0-9_]+)\]", out.stdout.decode()))


def doc_table(path):
    """{flag: env or None} from the table rows of path whose first cell is a `--flag`."""
    rows = {}
    problems = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.startswith("|"):
                continue
            # Cells split on "|" that is not escaped ("`mse\|prod`" stays one cell).
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:])]
            if not cells or not cells[0].startswith("`--"):
                continue
            m = re.match(r"`(--[a-z0-9][a-z0-9-]*)", cells[0])
            envs = re.findall(r"TQKV_[A-Z0-9_]+", cells[1]) if len(cells) > 1 else []
            if len(envs) > 1:
                problems.append("%s:%d: more than one variable on the row of %s" %
                                (path, n, m.group(1)))
            if m.group(1) in rows:
                problems.append("%s:%d: %s has two rows" % (path, n, m.group(1)))
            rows[m.group(1)] = envs[0] if envs else None
    return rows, problems


PRODUCT_DIRS = ("kernels/", "cache/", "transport/", "service/")


def check_other_env(src, doc_text):
    """Problems with the variables read outside the flag table."""
    problems = []
    files = tracked_files(src)
    read = {}
    used = set()
    for rel in files:
        path = os.path.join(src, rel)
        if rel.endswith(".md") or not os.path.isfile(path):
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        used.update(re.findall(r"TQKV_[A-Z0-9_]+", text))
        if rel.startswith(PRODUCT_DIRS):
            for v in re.findall(r"getenv\(\s*\"(TQKV_[A-Z0-9_]+)\"", text):
                read.setdefault(v, rel)
    for v, rel in sorted(read.items()):
        if not re.search(r"\b%s\b" % v, doc_text):
            problems.append("%s (read by %s) is not in %s" % (v, rel, FLAG_TABLE_DOC))
    section = doc_text.split("## Other variables", 1)[-1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if line.startswith("|"):
            first = re.split(r"(?<!\\)\|", line.strip()[1:])[0]
            for v in re.findall(r"TQKV_[A-Z0-9_]+(?![A-Z0-9_*])", first):
                if v not in used:
                    problems.append("%s is in the \"Other variables\" table of %s but no file "
                                    "of the repository uses it" % (v, FLAG_TABLE_DOC))
    return problems


def check_flags(src, server):
    opts, help_envs = help_options(server)
    if len(opts) < 10:
        return fail(["%s --help listed only %d flags: the parser no longer matches its format"
                     % (server, len(opts))])
    doc = os.path.join(src, FLAG_TABLE_DOC)
    rows, problems = doc_table(doc)
    for flag, env in sorted(opts.items()):
        if flag not in rows:
            problems.append("%s is in `tqkv-server --help` but not in the table of %s" %
                            (flag, FLAG_TABLE_DOC))
        elif rows[flag] != env:
            problems.append("%s: --help says variable %s, %s says %s" %
                            (flag, env, FLAG_TABLE_DOC, rows[flag]))
    for flag in sorted(set(rows) - set(opts)):
        problems.append("%s is in the table of %s but not in `tqkv-server --help`" %
                        (flag, FLAG_TABLE_DOC))
    doc_envs = {e for e in rows.values() if e}
    for env in sorted(help_envs - doc_envs):
        problems.append("%s is in `tqkv-server --help` but not in the table of %s" %
                        (env, FLAG_TABLE_DOC))
    for env in sorted(doc_envs - help_envs):
        problems.append("%s is in the table of %s but not in `tqkv-server --help`" %
                        (env, FLAG_TABLE_DOC))
    problems += check_other_env(src, open(doc, encoding="utf-8").read())
    if problems:
        return fail(problems)
    print("check_flags: %d flags and %d variables of --help match %s" %
          (len(opts), len(help_envs), FLAG_TABLE_DOC))
    return 0


def tracked_files(src):
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "-z"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=60, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    files = []  # not a git checkout (an unpacked source tree): walk it, builds excluded
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith((".git", "build", "node_modules"))]
        files += [os.path.relpath(os.path.join(root, n), src) for n in names]
    return files


def slug(heading):
    """GitHub's anchor of a heading."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(path):
    seen = {}
    out = set()
    in_code = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                k = seen.get(s, 0)
                seen[s] = k + 1
                out.add(s if k == 0 else "%s-%d" % (s, k))
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def check_links(src):
    problems = []
    files = tracked_files(src)
    for rel in files:
        path = os.path.join(src, rel)
        if not os.path.isfile(path):
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for ref in OUTSIDE_REFS:
            for n, line in enumerate(text.splitlines(), 1):
                if ref in line:
                    problems.append("%s:%d refers to %s, outside the repository" % (rel, n, ref))
        if not rel.endswith(".md"):
            continue
        in_code = False
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = path if not file_part else os.path.normpath(
                    os.path.join(os.path.dirname(path), file_part))
                if os.path.relpath(dest, src).split(os.sep)[0] == "..":
                    problems.append("%s:%d: link %s leaves the repository" % (rel, n, target))
                elif not os.path.exists(dest):
                    problems.append("%s:%d: link %s: no such file" % (rel, n, target))
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    problems.append("%s:%d: link %s: no heading with anchor #%s in %s" %
                                    (rel, n, target, anchor, os.path.relpath(dest, src)))
    if problems:
        return fail(problems)
    print("check_flags: links of %d Markdown files resolve; no reference outside the repository"
          % sum(1 for f in files if f.endswith(".md")))
    return 0


def main(argv):
    if len(argv) == 4 and argv[1] == "flags":
        return check_flags(argv[2], argv[3])
    if len(argv) == 3 and argv[1] == "links":
        return check_links(argv[2])
    print(__doc__.strip())
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
