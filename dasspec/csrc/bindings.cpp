// Python bindings of dasspec's CPU kernels (cpu_kernels.h).  The kernels touch no Python object: each releases the
// GIL while it runs, as torch's own ops do.
#include <torch/extension.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &dasspec::isa);
  m.def("set_isa", &dasspec::set_isa);
  m.def("isas_here", &dasspec::isas_here);
  m.def("linear", &dasspec::linear, nogil);
  m.def("rows_attention", &dasspec::rows_attention, nogil, arg("q"), arg("k"), arg("v"), arg("rows"), arg("starts"),
        arg("lengths"), arg("scale"), arg("k_prefix") = py::none(), arg("v_prefix") = py::none(),
        arg("prefix_lengths") = py::none());
  m.def("store_rows", &dasspec::store_rows, nogil);
  m.def("rms_norm", &dasspec::rms_norm, nogil);
  m.def("argmax_rows", &dasspec::argmax_rows, nogil);
  m.def("pointwise", &dasspec::pointwise, nogil);
  m.def("rope_half", &dasspec::rope_half, nogil);
  m.def("rope_pairs", &dasspec::rope_pairs, nogil);
  m.def("attention_rows", &dasspec::attention_rows, nogil);
  m.def("loop_mix_rows", &dasspec::loop_mix_rows, nogil);
  m.def("mlp_rows", &dasspec::mlp_rows, nogil);
  m.def("peri_layer_rows", &dasspec::peri_layer_rows, nogil);
  m.def("pre_layer_rows", &dasspec::pre_layer_rows, nogil);
  m.def("sandwich_layer_rows", &dasspec::sandwich_layer_rows, nogil);
  m.def("recur_rows", &dasspec::recur_rows, nogil);
  m.def("loop_recur_rows", &dasspec::loop_recur_rows, nogil);
}
