// The Python module tp_ext._C: loading it registers every op (static initialisers of the
// TORCH_LIBRARY blocks); it also exposes the process-wide communication settings.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/version.h>

#include <string>

#include "comm/collective_checks.h"
#include "comm/settings.h"
#include "comm/shm_channel.h"
#include "comm/stats.h"
#include "common/gemm.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tp_ext native ops (torch.ops.tp_ext.*) and communication settings";
  // what this build was compiled against (tp-ext doctor compares it with the running torch)
  m.def("_built_with_torch", [] { return std::string(TORCH_VERSION); });
  m.def("_cpu_gemm", &tp_ext::cpu_gemm);
  m.def("_set_cpu_gemm", &tp_ext::set_cpu_gemm);
  m.def("_set_tracking", &tp_ext::comm::set_tracking);
  m.def("_tracking", &tp_ext::comm::tracking);
  m.def("_reset_stats", &tp_ext::comm::reset_stats);
  m.def("_stats", &tp_ext::comm::stats_snapshot);
  m.def("_set_tag", &tp_ext::comm::set_tag);
  m.def("_get_tag", &tp_ext::comm::get_tag);
  // transfers made from Python (ring attention's point-to-point hops): one call, under the tag
  m.def("_record",
        [](const std::string& op, const std::string& collective, int64_t bytes, double seconds) {
    tp_ext::comm::record(op.c_str(), collective.c_str(), bytes, seconds);
  });
  m.def("_set_timeout_ms", &tp_ext::comm::set_timeout_ms);
  m.def("_timeout_ms", &tp_ext::comm::timeout_ms);
  // None: follow the environment variable again (TP_EXT_CHECK_COLLECTIVES, TP_EXT_SHM).
  m.def("_set_consistency_checks", &tp_ext::comm::set_consistency_checks);
  m.def("_consistency_checks", &tp_ext::comm::consistency_checks);
  m.def("_set_shm_enabled", &tp_ext::comm::set_shm_enabled);
  // "" when every TP_EXT_* variable the communication layer reads is valid, else why not (what
  // the first collective would raise; tp-ext doctor reports it before a run)
  m.def("_env_error", [] { return tp_ext::comm::read_env().error; });
  m.def("_shm_active", [](const std::string& name) { return tp_ext::comm::shm_active(name); });
}
