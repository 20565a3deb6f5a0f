// Backend selection by name (--backend): ref (scalar float32 oracle), cpu (SIMD), cuda.
#include "backend/backend.h"
#include "core/error.h"

namespace dsv3 {

std::vector<std::string> backend_names() {
  std::vector<std::string> v = {"ref", "cpu"};
#ifdef DSV3_HAVE_CUDA
  v.push_back("cuda");
#endif
  return v;
}

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "ref") return make_ref_backend();
  if (name == "cpu") return make_cpu_backend();
#ifdef DSV3_HAVE_CUDA
  if (name == "cuda") return make_cuda_backend();
#endif
  std::string known;
  for (auto& n : backend_names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown backend '", name, "' (this build has: ", known, ")");
}

}  // namespace dsv3
