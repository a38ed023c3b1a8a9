#!/usr/bin/env python3
"""test_cdef_layout.py - the Python package's C declarations (tqkv/_ffi.py CDEF, a copy
of the public headers that cffi lays structs out from) agree with the headers.

For every struct typedef of CDEF: its size and each field's offset and size as cffi
computes them, against sizeof/offsetof from the C compiler on the real headers. For every
function of CDEF: its declaration, assigned as a function pointer to the real function
under -Werror (a changed parameter or return type is a compile error). For every
constant of CDEF (#define NAME N, enum members): a _Static_assert that the header has the
same value. The headers are the installed ones (docs/api.md), nothing else.

The program links against $TQKV_LIBRARY (libtqkv.so), so every declared function is
also shown to be exported.

usage: TQKV_LIBRARY=.../libtqkv.so test_cdef_layout.py SOURCE_DIR [CC]
"""
import os
import re
import subprocess
import sys
import tempfile

SRC = sys.argv[1]
CC = sys.argv[2] if len(sys.argv) > 2 else "cc"

import ast  # noqa: E402

import cffi  # noqa: E402


def read_cdef():
    """CDEF's text, read from _ffi.py without importing the package (which loads the
    library)."""
    path = os.path.join(SRC, "transport", "python", "tqkv", "_ffi.py")
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CDEF":
            return ast.literal_eval(node.value)
    raise SystemExit("FAIL: no CDEF in " + path)


CDEF = read_cdef()

HEADERS = ["transport/client.h", "transport/client_bulk.h", "kernels/block_shape.h",
           "kernels/status.h", "kernels/version.h"]


def main():
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    structs = re.findall(r"typedef struct \w+ \{.*?\} (\w+);", CDEF, re.S)
    funcs = [m.group(0) for m in re.finditer(r"^(?!typedef)[A-Za-z_][^;{}]*?\(\s*\*?\s*\w*\s*\)?"
                                               r"[^;{}]*\)\s*;", CDEF, re.M)]
    if len(structs) < 10 or len(funcs) < 20:
        print("FAIL: parsed only %d structs and %d functions from CDEF" % (len(structs),
                                                                           len(funcs)))
        return 1
    consts = re.findall(r"^#define\s+(TQKV_\w+)\s+(\d+)\s*$", CDEF, re.M)
    for body in re.findall(r"enum\s*\{(.*?)\}", CDEF, re.S):
        consts += re.findall(r"(TQKV_\w+)\s*=\s*(\d+)", body)
    if len(consts) < 10:
        print("FAIL: parsed only %d constants from CDEF" % len(consts))
        return 1
    want = {}
    lines = ["#include <stddef.h>", "#include <stdio.h>"]
    lines += ['#include "%s"' % h for h in HEADERS]
    lines += ['_Static_assert(%s == %s, "CDEF: %s = %s");' % (n, v, n, v) for n, v in consts]
    body = []
    for s in structs:
        want["%s size" % s] = ffi.sizeof(s)
        body.append('printf("%%s size %%zu\\n", "%s", sizeof(%s));' % (s, s))
        for name, field in ffi.typeof(s).fields:
            want["%s.%s" % (s, name)] = ffi.offsetof(s, name)
            body.append('printf("%%s.%%s %%zu\\n", "%s", "%s", offsetof(%s, %s));' %
                        (s, name, s, name))
            want["%s.%s size" % (s, name)] = ffi.sizeof(field.type)
            body.append('printf("%%s.%%s size %%zu\\n", "%s", "%s", sizeof(((%s *)0)->%s));' %
                        (s, name, s, name))
    for i, f in enumerate(funcs):
        decl = " ".join(f.split())
        m = re.match(r"(.*?\W)(\w+)\s*\((.*)\)\s*;$", decl)
        if not m:
            print("FAIL: cannot read the declaration %r" % decl)
            return 1
        ret, name, args = m.groups()
        lines.append("static %s(*const fp_%d)(%s) __attribute__((unused)) = %s;" %
                     (ret, i, args, name))
    lines.append("int main(void) {")
    lines += body
    lines.append("return 0; }")
    with tempfile.TemporaryDirectory() as tmp:
        c = os.path.join(tmp, "layout.c")
        exe = os.path.join(tmp, "layout")
        with open(c, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        libso = os.environ.get("TQKV_LIBRARY", "")
        if not libso:
            print("FAIL: TQKV_LIBRARY (the path of libtqkv.so) is not set")
            return 1
        r = subprocess.run([CC, "-std=c11", "-Wall", "-Werror", "-I" + SRC, c, "-o", exe, libso,
                            "-Wl,-rpath," + os.path.dirname(os.path.abspath(libso))],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-4000:])
            print("FAIL: a CDEF declaration does not match the headers (see above)")
            return 1
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        k, v = line.rsplit(" ", 1)
        got[k] = int(v)
    bad = ["%s: cffi %s, C %s" % (k, want[k], got.get(k)) for k in want if got.get(k) != want[k]]
    for b in bad:
        print("FAIL: " + b)
    print("%d structs (%d sizes and offsets of them and their fields), %d functions, %d "
          "constants checked against the headers" % (len(structs), len(want), len(funcs),
                                                      len(consts)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
