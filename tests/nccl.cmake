# nccl.cmake - the NCCL transport (issue 8).
#
# check_nccl (label server): a real tqkv-server on loopback with every CUDA device
# hidden: OpenChannel and a Get with transport NCCL answer FAILED_PRECONDITION, and
# tqkv_client_get_nccl falls back to gRPC with byte-identical pages. Runs in every
# build (with or without CUDA/NCCL).
#
# check_nccl_gpu (label gpu, NCCL builds only; exit 77 without a CUDA device): the
# server (TQKV_NCCL_DEVICE) and the client share one machine; a channel moves pages
# with ncclSend/ncclRecv into device buffers and they must equal the gRPC bytes.
# What needs two GPUs: NCCL refuses two ranks of one communicator on the same device
# ("Duplicate GPU detected"), so with a single GPU the channel cannot form and the
# test exits 77 after checking that the client fell back cleanly. With two or more
# devices the server uses device 1 and the client device 0, and the whole NCCL path
# (staging ring, window back-pressure, ordering, CloseChannel) is exercised.
if(TARGET tqkv-server)
  tqkv_check_suite(check_nccl
    SOURCES ${PROJECT_SOURCE_DIR}/tests/check_nccl.c
    LIBS tqkv
    LABELS server
    TIMEOUT 120)
  set_tests_properties(check_nccl PROPERTIES
    ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>;CUDA_VISIBLE_DEVICES=")

  if(TQKV_HAVE_NCCL)
    tqkv_check_suite(check_nccl_gpu
      SOURCES ${PROJECT_SOURCE_DIR}/tests/check_nccl_gpu.c
      LIBS tqkv ${NCCL_LIBRARY} CUDA::cudart
      LABELS gpu
      TIMEOUT 300)
    set_tests_properties(check_nccl_gpu PROPERTIES
      ENVIRONMENT "CK_DEFAULT_TIMEOUT=600;TQKV_SERVER=$<TARGET_FILE:tqkv-server>")
  endif()
endif()
