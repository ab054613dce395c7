"""The reason a failed build of SGLang's page-key hash gives (`integration.keys.build_error`), from the messages
torch's extension builder raises: the compiler's or linker's own line, never the echoed command."""

from __future__ import annotations

from sglang_tiered.integration.keys import build_error

COMMAND = ("/usr/bin/c++ -MMD -MF hash_binding.o.d -DTORCH_EXTENSION_NAME=hicache_hash_cpp -isystem /venv/include "
           "-fPIC -O3 -c /venv/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp -o hash_binding.o")


def built(*output: str) -> RuntimeError:
    head = f"Error building extension 'hicache_hash_cpp': [1/2] {COMMAND}"
    return RuntimeError("\n".join([head, "FAILED: hash_binding.o", COMMAND, *output,
                                   "ninja: build stopped: subcommand failed."]))


def test_the_compilers_line_is_the_reason():
    exc = built("hash_binding.cpp:5:10: fatal error: openssl/sha.h: No such file or directory",
                "    5 | #include <openssl/sha.h>", "      |          ^~~~~~~~~~~~~~~", "compilation terminated.")
    assert build_error(exc) == "hash_binding.cpp:5:10: fatal error: openssl/sha.h: No such file or directory"


def test_a_missing_compiler_and_a_missing_library():
    assert build_error(built("/bin/sh: 1: /opt/no-such-c++: not found")) == "/bin/sh: 1: /opt/no-such-c++: not found"
    exc = built("/usr/bin/ld: cannot find -lcrypto: No such file or directory",
                "collect2: error: ld returned 1 exit status")
    assert build_error(exc) == "/usr/bin/ld: cannot find -lcrypto: No such file or directory"


def test_anything_else_gives_its_last_line():
    exc = RuntimeError("Command '['/bin/false', '--version']' returned non-zero exit status 1.")
    assert build_error(exc) == str(exc)
    assert len(build_error(RuntimeError("x" * 1000))) == 300
