// A checkpoint directory: Hugging Face layout (config.json + model.safetensors or shards listed
// by model.safetensors.index.json) or the reference's converted layout
// (model{rank}-mp{N}.safetensors with its short names, plus a ModelArgs JSON). Every tensor is
// reachable under its reference name (see hf_to_ref_name), as a zero-copy view into an mmap.
// The config is kept as text; model/config.h's load_model_args(Checkpoint) parses it.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"

namespace dsv3 {

// Maps a Hugging Face tensor name to the reference's (convert.py's mapping):
// "model.layers.3.self_attn.q_a_proj.weight_scale_inv" -> "layers.3.attn.wq_a.scale".
// Names without a mapping keep their shape of words ("model." dropped).
std::string hf_to_ref_name(const std::string& hf_name);
// The inverse over every name of a weight manifest: "layers.3.attn.wq_a.scale" ->
// "model.layers.3.self_attn.q_a_proj.weight_scale_inv", "head.weight" -> "lm_head.weight".
std::string ref_to_hf_name(const std::string& ref_name);

class Checkpoint {
 public:
  // `config_path` overrides the config file (needed for the reference layout, whose converted
  // directory may hold no config); default: dir/config.json. `rank`/`world` pick the reference
  // layout's shard file model{rank}-mp{world}.safetensors.
  static std::unique_ptr<Checkpoint> open(const std::string& dir, const std::string& config_path = "",
                                          int rank = 0, int world = 1);

  const std::string& config_text() const { return config_text_; }  // the config file's JSON, unparsed
  const std::string& config_path() const { return config_path_; }  // where it was read from
  const std::string& dir() const { return dir_; }
  const std::string& layout() const { return layout_; }  // "hf" or "reference"
  bool has(const std::string& ref_name) const { return where_.count(ref_name) != 0; }
  TensorView get(const std::string& ref_name) const;  // Error naming the tensor when missing
  std::vector<std::string> names() const;
  // The file a tensor lives in (for messages).
  const std::string& file_of(const std::string& ref_name) const;
  // Drops the files' pages from this process (after the weights were copied out; views into the
  // files stay valid, a read maps the page again).
  void release_pages();

 private:
  std::string dir_, layout_, config_path_, config_text_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<size_t, std::string>> where_;  // ref name -> (file, name in file)
};

}  // namespace dsv3
