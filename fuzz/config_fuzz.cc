// libFuzzer target: arbitrary bytes as the text of a config.json / reference ModelArgs JSON.
// Refusing with dsv3::Error is fine; any other exception or a sanitizer report is a bug, and an
// accepted config must satisfy what validate() promises to the code that sizes the model.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "model/config.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dsv3::ModelArgs a;
  try {
    a = dsv3::parse_model_args(std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
  } catch (const dsv3::Error&) {
    return 0;
  }
  require(a.dim > 0 && a.n_layers > 0 && a.n_heads > 0 && a.vocab_size > 0);
  require(a.qk_rope_head_dim > 0 && a.qk_rope_head_dim % 2 == 0 && a.kv_lora_rank > 0);
  require(a.moe_layer_freq > 0 && a.n_dense_layers >= 0);
  for (int i : {0, 1, a.n_dense_layers, a.n_layers - 1}) {
    if (i < 0 || i >= a.n_layers) continue;
    if (a.is_moe_layer(i)) {
      require(a.n_activated_experts > 0 && a.n_activated_experts <= a.n_routed_experts);
      require(a.n_expert_groups > 0 && a.n_routed_experts % a.n_expert_groups == 0);
      require(a.n_limited_groups > 0 && a.n_limited_groups <= a.n_expert_groups);
      require(a.moe_inter_dim > 0);
    } else {
      require(a.inter_dim > 0);
    }
  }
  volatile float s = a.softmax_scale();
  (void)s;
  return 0;
}
