#include "io/checkpoint.h"

#include <dirent.h>

#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace dsv3 {

using json = nlohmann::json;

// convert.py's word mapping, Hugging Face word -> reference word; ref_to_hf_name inverts it.
static const std::map<std::string, std::string>& hf_words() {
  static const std::map<std::string, std::string> kWords = {
      {"embed_tokens", "embed"},     {"input_layernorm", "attn_norm"},
      {"post_attention_layernorm", "ffn_norm"}, {"q_proj", "wq"},
      {"q_a_proj", "wq_a"},          {"q_a_layernorm", "q_norm"},
      {"q_b_proj", "wq_b"},          {"kv_a_proj_with_mqa", "wkv_a"},
      {"kv_a_layernorm", "kv_norm"}, {"kv_b_proj", "wkv_b"},
      {"o_proj", "wo"},              {"gate_proj", "w1"},
      {"down_proj", "w2"},           {"up_proj", "w3"},
      {"lm_head", "head"},           {"self_attn", "attn"},
      {"mlp", "ffn"},                {"weight_scale_inv", "scale"},
      {"e_score_correction_bias", "bias"}};
  return kWords;
}

// Applies `words` to each dot-separated word of `name`.
static std::string map_words(const std::string& name, const std::map<std::string, std::string>& words) {
  std::string out, word;
  auto flush = [&] {
    auto it = words.find(word);
    if (!out.empty()) out += '.';
    out += it == words.end() ? word : it->second;
    word.clear();
  };
  for (char c : name) {
    if (c == '.') flush();
    else word += c;
  }
  flush();
  return out;
}

std::string hf_to_ref_name(const std::string& hf) {
  std::string name = hf;
  if (name.rfind("model.", 0) == 0) name = name.substr(6);
  return map_words(name, hf_words());
}

std::string ref_to_hf_name(const std::string& ref) {
  static const std::map<std::string, std::string> kInverse = [] {
    std::map<std::string, std::string> inv;
    for (auto& [hf, r] : hf_words()) inv[r] = hf;
    return inv;
  }();
  std::string hf = map_words(ref, kInverse);
  // Everything but the output head lives under "model." (lm_head.weight is top level).
  return hf.rfind("lm_head.", 0) == 0 ? hf : "model." + hf;
}

static std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) fail(dir, ": cannot open model directory");
  while (auto* e = ::readdir(d)) out.push_back(e->d_name);
  ::closedir(d);
  return out;
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir, const std::string& config_path,
                                             int rank, int world) {
  auto ck = std::make_unique<Checkpoint>();
  ck->dir_ = dir;
  std::vector<std::string> entries = list_dir(dir);
  std::set<std::string> present(entries.begin(), entries.end());
  std::string ref_file = "model" + std::to_string(rank) + "-mp" + std::to_string(world) + ".safetensors";

  ck->config_path_ = config_path;
  if (ck->config_path_.empty()) {
    if (!present.count("config.json"))
      fail(dir, ": no config.json (pass --config for a reference-layout directory)");
    ck->config_path_ = dir + "/config.json";
  }
  ck->config_text_ = read_text_file(ck->config_path_);

  auto add_file = [&](const std::string& fname, bool hf_names,
                      const std::set<std::string>* expected) -> void {
    ck->files_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + fname));
    size_t idx = ck->files_.size() - 1;
    for (auto& [name, e] : ck->files_.back()->entries()) {
      if (expected && !expected->count(name)) continue;
      std::string ref = hf_names ? hf_to_ref_name(name) : name;
      if (ck->where_.count(ref))
        fail(dir, ": tensor '", name, "' appears twice (", fname, " and ",
             ck->files_[ck->where_[ref].first]->path(), ")");
      ck->where_[ref] = {idx, name};
    }
  };

  if (present.count("model.safetensors.index.json")) {
    ck->layout_ = "hf";
    std::string ipath = dir + "/model.safetensors.index.json";
    json j;
    try {
      j = json::parse(read_text_file(ipath));
    } catch (const json::exception& e) {
      fail(ipath, ": not valid JSON: ", e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(ipath, ": missing the weight_map object");
    std::map<std::string, std::set<std::string>> by_file;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(ipath, ": weight_map['", it.key(), "'] is not a file name");
      std::string f = it.value().get<std::string>();
      if (f.find('/') != std::string::npos) fail(ipath, ": shard name '", f, "' must be a plain file name");
      by_file[f].insert(it.key());
    }
    for (auto& [f, names] : by_file) {
      if (!present.count(f)) fail(ipath, " names shard '", f, "', which is missing from ", dir);
      add_file(f, true, &names);
      for (auto& n : names)
        if (!ck->files_.back()->has(n))
          fail(ipath, " places tensor '", n, "' in ", f, ", which does not contain it");
    }
  } else if (present.count("model.safetensors")) {
    ck->layout_ = "hf";
    add_file("model.safetensors", true, nullptr);
  } else if (present.count(ref_file)) {
    ck->layout_ = "reference";
    add_file(ref_file, false, nullptr);
  } else {
    fail(dir, ": no model.safetensors, model.safetensors.index.json or ", ref_file);
  }
  return ck;
}

TensorView Checkpoint::get(const std::string& ref_name) const {
  auto it = where_.find(ref_name);
  if (it == where_.end()) fail(dir_, ": missing tensor '", ref_name, "'");
  return files_[it->second.first]->get(it->second.second);
}

const std::string& Checkpoint::file_of(const std::string& ref_name) const {
  auto it = where_.find(ref_name);
  if (it == where_.end()) fail(dir_, ": missing tensor '", ref_name, "'");
  return files_[it->second.first]->path();
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (auto& [k, _] : where_) v.push_back(k);
  return v;
}

void Checkpoint::release_pages() {
  for (auto& f : files_) f->mapping().release();
}

}  // namespace dsv3
