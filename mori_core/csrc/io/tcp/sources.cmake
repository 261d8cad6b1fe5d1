list(APPEND MORI_IO_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/peer_link.cpp
  ${CMAKE_CURRENT_LIST_DIR}/inbound.cpp
  ${CMAKE_CURRENT_LIST_DIR}/heartbeat.cpp
  ${CMAKE_CURRENT_LIST_DIR}/tcp_backend.cpp
  ${CMAKE_CURRENT_LIST_DIR}/gpu_staging.cpp)
