# attention.cmake - fused decode attention, BF16/KIVI baselines and the KV policy (attn).
tqkv_check_suite(check_attention SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_attention.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 300)
tqkv_check_suite(check_policy SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/check_policy.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 60)
# The multi-threaded split-K case alone, for the ThreadSanitizer run (ctest -L concurrency).
add_test(NAME check_attention_threads COMMAND check_attention)
set_tests_properties(check_attention_threads PROPERTIES LABELS "concurrency" TIMEOUT 300
  ENVIRONMENT "CK_RUN_CASE=threads;CK_DEFAULT_TIMEOUT=600")

# tqkv-codec KV subcommands (kernels/cli/kv_cli.c): smoke runs and exit codes.
add_test(NAME cli_attn_eval_smoke
  COMMAND tqkv-codec attn-eval --tokens 300 --heads 2 --dim 64 --query-heads 4 --json)
set_tests_properties(cli_attn_eval_smoke PROPERTIES LABELS "unit" TIMEOUT 120
  PASS_REGULAR_EXPRESSION "\"method\":\"KIVI-3")
add_test(NAME cli_attn_bench_smoke
  COMMAND tqkv-codec attn-bench --tokens 600 --heads 2 --query-heads 8 --dim 64 --iters 2)
set_tests_properties(cli_attn_bench_smoke PROPERTIES LABELS "unit" TIMEOUT 120
  PASS_REGULAR_EXPRESSION "sanity: fused vs its reference rel err [0-9.]+e-0[6-9]")
# encode-kv -> decode-kv -> attend round trip on deterministic BF16 data (values 0.5..1.5
# built by printf), then the error paths: usage errors exit 2, bad input exits 1.
add_test(NAME cli_kv_roundtrip
  COMMAND sh -c "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; \
    i=0; : > $d/k; while [ $i -lt 4096 ]; do printf '\\000\\077\\200\\077\\300\\077\\100\\077' >> $d/k; i=$((i+1)); done; \
    cp $d/k $d/v; \
    $<TARGET_FILE:tqkv-codec> encode-kv --tokens 256 --heads 2 --dim 32 --key-bits 3.5 --value-bits 3 --norm-correction --key-centering --block 100 $d/k $d/v $d/p.tqp; \
    $<TARGET_FILE:tqkv-codec> decode-kv --format f32 $d/p.tqp $d/ko $d/vo; \
    test $(wc -c < $d/ko) -eq 65536; \
    head -c 256 $d/ko > $d/q; \
    $<TARGET_FILE:tqkv-codec> attend --query $d/q --query-heads 2 $d/o $d/p.tqp; \
    test $(wc -c < $d/o) -eq 256; \
    rc=0; $<TARGET_FILE:tqkv-codec> attend --query $d/q --query-heads 3 $d/o $d/p.tqp || rc=$?; test $rc -eq 1; \
    rc=0; $<TARGET_FILE:tqkv-codec> attend --query $d/q $d/o $d/p.tqp || rc=$?; test $rc -eq 2; \
    rc=0; $<TARGET_FILE:tqkv-codec> encode-kv --tokens 257 --heads 2 --dim 32 --key-bits 3 --value-bits 3 $d/k $d/v $d/x || rc=$?; test $rc -eq 1; \
    rc=0; $<TARGET_FILE:tqkv-codec> encode-kv --tokens 256 --heads 2 --dim 32 --key-bits 3.3 --value-bits 3 $d/k $d/v $d/x || rc=$?; test $rc -eq 2; \
    head -c 1000 $d/p.tqp > $d/t.tqp; rc=0; $<TARGET_FILE:tqkv-codec> decode-kv $d/t.tqp $d/a $d/b || rc=$?; test $rc -eq 1; \
    $<TARGET_FILE:tqkv-codec> attn-eval --help > /dev/null")
set_tests_properties(cli_kv_roundtrip PROPERTIES LABELS "unit" TIMEOUT 120)
