# codec.cmake - unit suites of the TurboQuant codec (kernels/codebook.c, rotation.c,
# page.c and the SIMD kernels): codebook tables, rotations, bit packing and SIMD vs
# reference, page validation, and distortion / bias against theory.

foreach(_s codebook rotation pack page quality)
  set(_name check_codec_${_s})
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/tests/check_codec_${_s}.c)
    continue()
  endif()
  tqkv_check_suite(${_name}
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_codec_${_s}.c
    LIBS tqkv_kernels
    LABELS unit
    TIMEOUT 900)
endforeach()

# The tool itself, run as a user would (needs the tqkv-codec target).
if(TARGET tqkv-codec AND EXISTS ${PROJECT_SOURCE_DIR}/tests/check_codec_cli.c)
  tqkv_check_suite(check_codec_cli
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_codec_cli.c
    LIBS tqkv_kernels
    LABELS unit
    TIMEOUT 300)
  target_compile_definitions(check_codec_cli PRIVATE TQKV_CODEC_BIN="$<TARGET_FILE:tqkv-codec>")
  add_dependencies(check_codec_cli tqkv-codec)
endif()

# The one CPU detection and TQKV_ISA cap (kernels/cpu.h), under every cap, and the
# deprecated attention-only alias TQKV_ATTN_ISA.
tqkv_check_suite(check_cpu SOURCES ${PROJECT_SOURCE_DIR}/tests/check_cpu.c
  LIBS tqkv_kernels LABELS unit TIMEOUT 60)
foreach(_env "TQKV_ISA=avx2" "TQKV_ISA=scalar" "TQKV_ATTN_ISA=avx2" "TQKV_ATTN_ISA=scalar")
  string(REGEX REPLACE "^TQKV_([A-Z_]+)=(.*)$" "\\1_\\2" _n "${_env}")
  string(TOLOWER "${_n}" _n)
  add_test(NAME check_cpu_${_n} COMMAND check_cpu)
  set_tests_properties(check_cpu_${_n} PROPERTIES LABELS unit TIMEOUT 60 ENVIRONMENT "${_env}")
endforeach()

# The SIMD levels below the best one this CPU has, so every kernel runs on one machine
# (TQKV_ISA caps every dispatch: kernels/cpu.h).
foreach(_isa avx2 scalar)
  foreach(_s check_codec_pack check_codec_page)
    if(TARGET ${_s})
      add_test(NAME ${_s}_${_isa} COMMAND ${_s})
      set_tests_properties(${_s}_${_isa} PROPERTIES LABELS unit TIMEOUT 900
        ENVIRONMENT "TQKV_ISA=${_isa};CK_DEFAULT_TIMEOUT=600")
    endif()
  endforeach()
endforeach()

# Many threads through the codec caches (also run under TSan: label concurrency).
if(EXISTS ${PROJECT_SOURCE_DIR}/tests/check_codec_threads.c)
  tqkv_check_suite(check_codec_threads
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_codec_threads.c
    LIBS tqkv_kernels
    LABELS unit concurrency
    TIMEOUT 300)
endif()
