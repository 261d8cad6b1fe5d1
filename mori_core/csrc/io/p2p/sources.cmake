# Intra-node GPU backend (BackendType.XGMI): GPU builds only.
if(MORI_GPU_LANG)
  list(APPEND MORI_IO_SOURCES
    ${CMAKE_CURRENT_LIST_DIR}/ipc_cache.cpp
    ${CMAKE_CURRENT_LIST_DIR}/signal_slots.cpp
    ${CMAKE_CURRENT_LIST_DIR}/stream_pool.cpp
    ${CMAKE_CURRENT_LIST_DIR}/completion_waiter.cpp
    ${CMAKE_CURRENT_LIST_DIR}/xgmi_backend.cpp)
  list(APPEND MORI_IO_GPU_SOURCES ${CMAKE_CURRENT_LIST_DIR}/scatter_copy.cu ${CMAKE_CURRENT_LIST_DIR}/copy_proxy.cu)
endif()
