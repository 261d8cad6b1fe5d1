# RDMA backend (libibverbs is dlopen'ed at run time: nothing to link).
# rdma_bindings.cpp is not listed: it is compiled into the extension module
# (see the hook described in docs/rdma.md).
list(APPEND MORI_IO_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/verbs_api.cpp
  ${CMAKE_CURRENT_LIST_DIR}/device_filter.cpp
  ${CMAKE_CURRENT_LIST_DIR}/pci_topology.cpp
  ${CMAKE_CURRENT_LIST_DIR}/roce_gid.cpp
  ${CMAKE_CURRENT_LIST_DIR}/post_planner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/completion_errors.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rdma_settings.cpp
  ${CMAKE_CURRENT_LIST_DIR}/control_protocol.cpp
  ${CMAKE_CURRENT_LIST_DIR}/gpu_dmabuf.cpp
  ${CMAKE_CURRENT_LIST_DIR}/nic.cpp
  ${CMAKE_CURRENT_LIST_DIR}/queue_pair.cpp
  ${CMAKE_CURRENT_LIST_DIR}/completion_poller.cpp
  ${CMAKE_CURRENT_LIST_DIR}/post_workers.cpp
  ${CMAKE_CURRENT_LIST_DIR}/peer_link.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rdma_core.cpp
  ${CMAKE_CURRENT_LIST_DIR}/control_server.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rdma_backend.cpp)
