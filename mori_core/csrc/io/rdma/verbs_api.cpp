#include "io/rdma/verbs_api.hpp"

#include <dlfcn.h>

#include "common/env.hpp"
#include "common/logging.hpp"

namespace mori::io::rdma {
namespace {

constexpr const char* kDefaultLibrary = "libibverbs.so.1";
constexpr const char* kInstallHint =
    "install rdma-core's libibverbs (Debian/Ubuntu: `apt install libibverbs1 ibverbs-providers`, "
    "RHEL: `dnf install libibverbs`) or point MORI_IBVERBS_LIBRARY at libibverbs.so.1";

struct Loaded {
  VerbsApi api;
  bool ok = false;
  std::string error;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* out, bool required, std::string* missing) {
  // dlsym returns the default symbol version, the one verbs.h links against.
  void* p = dlsym(lib, name);
  *out = reinterpret_cast<Fn>(p);
  if (!p && required) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
  }
  return p != nullptr;
}

Loaded Load() {
  Loaded l;
  std::string path = kDefaultLibrary;
  if (auto env = env::GetString("MORI_IBVERBS_LIBRARY"); env && !env->empty()) path = *env;
  // RTLD_LOCAL: the symbols stay private to us, never interposing a framework's own copy.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    l.error = "libibverbs could not be loaded (dlopen(\"" + path + "\"): " + (why ? why : "unknown error") +
              "); " + kInstallHint;
    return l;
  }
  VerbsApi& a = l.api;
  a.libraryPath = path;
  std::string missing;
  Resolve(lib, "ibv_get_device_list", &a.get_device_list, true, &missing);
  Resolve(lib, "ibv_free_device_list", &a.free_device_list, true, &missing);
  Resolve(lib, "ibv_get_device_name", &a.get_device_name, true, &missing);
  Resolve(lib, "ibv_open_device", &a.open_device, true, &missing);
  Resolve(lib, "ibv_close_device", &a.close_device, true, &missing);
  Resolve(lib, "ibv_query_device", &a.query_device, true, &missing);
  Resolve(lib, "ibv_query_port", &a.query_port, true, &missing);
  Resolve(lib, "ibv_query_gid", &a.query_gid, true, &missing);
  Resolve(lib, "ibv_alloc_pd", &a.alloc_pd, true, &missing);
  Resolve(lib, "ibv_dealloc_pd", &a.dealloc_pd, true, &missing);
  Resolve(lib, "ibv_reg_mr", &a.reg_mr, true, &missing);
  Resolve(lib, "ibv_reg_mr_iova2", &a.reg_mr_iova2, false, &missing);
  Resolve(lib, "ibv_reg_dmabuf_mr", &a.reg_dmabuf_mr, false, &missing);
  Resolve(lib, "ibv_dereg_mr", &a.dereg_mr, true, &missing);
  Resolve(lib, "ibv_create_comp_channel", &a.create_comp_channel, true, &missing);
  Resolve(lib, "ibv_destroy_comp_channel", &a.destroy_comp_channel, true, &missing);
  Resolve(lib, "ibv_create_cq", &a.create_cq, true, &missing);
  Resolve(lib, "ibv_destroy_cq", &a.destroy_cq, true, &missing);
  Resolve(lib, "ibv_get_cq_event", &a.get_cq_event, true, &missing);
  Resolve(lib, "ibv_ack_cq_events", &a.ack_cq_events, true, &missing);
  Resolve(lib, "ibv_create_qp", &a.create_qp, true, &missing);
  Resolve(lib, "ibv_modify_qp", &a.modify_qp, true, &missing);
  Resolve(lib, "ibv_destroy_qp", &a.destroy_qp, true, &missing);
  Resolve(lib, "ibv_wc_status_str", &a.wc_status_str, true, &missing);
  if (!missing.empty()) {
    l.error = path + " lacks required symbols (" + missing + "); it is too old or not libibverbs — " + kInstallHint;
    dlclose(lib);
    return l;
  }
  // The handle is intentionally never closed: providers loaded by libibverbs
  // keep pointers into it for the life of the process.
  l.ok = true;
  MORI_INFO("RDMA: loaded " << path << (a.reg_dmabuf_mr ? " (dma-buf registration available)" : ""));
  return l;
}

const Loaded& Instance() {
  static const Loaded loaded = Load();
  return loaded;
}

}  // namespace

const VerbsApi* Verbs() {
  const Loaded& l = Instance();
  return l.ok ? &l.api : nullptr;
}

std::string VerbsLoadError() { return Instance().error; }

}  // namespace mori::io::rdma
