// libFuzzer target: arbitrary bytes as the body of POST /v1/chat/completions and
// /v1/completions. Refusing with ApiError (status 400) is fine; any other exception or a
// sanitizer report is a bug, and an accepted request must hold what the server relies on. The
// accepted stop strings then run through the stop matcher and the reasoning split on text cut
// at every byte.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/api_request.h"
#include "server/text_stream.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}

void check(const dsv3::server::ApiRequest& r, const std::string& text) {
  using namespace dsv3::server;
  require(r.n >= 1 && r.n <= kMaxChoices);
  require(!r.max_tokens || *r.max_tokens >= 1);
  require(r.logprobs >= -1 && r.logprobs <= kMaxTopLogprobs);
  require(r.stop.size() <= size_t(kMaxStopStrings));
  for (const std::string& s : r.stop) require(!s.empty());
  require(r.include_usage ? r.stream : true);
  r.sampling.validate();  // throws dsv3::Error (an abort here) when the parser let a bad value through
  if (r.endpoint == Endpoint::kChat) {
    require(r.messages.is_array() && !r.messages.empty());
    for (const auto& m : r.messages) require(m["content"].is_string() || m["content"].is_null());
  } else {
    require(!r.prompts.empty() && r.prompts.size() <= size_t(kMaxPrompts));
    for (const auto& p : r.prompts) require(!p.is_ids || !p.ids.empty());
  }
  // The text stream pieces on the body's own bytes, pushed one byte at a time.
  StopMatcher stop(r.stop);
  ReasoningSplitter split(text.size() % 2 == 0);
  std::string out;
  for (char c : text) {
    std::string piece = stop.push(std::string(1, c));
    TextDelta d = split.push(piece);
    out += d.reasoning + d.content;
  }
  if (!stop.matched()) {
    TextDelta d = split.push(stop.flush());
    out += d.reasoning + d.content;
  }
  TextDelta d = split.flush();
  out += d.reasoning + d.content;
  require(out.size() <= text.size());
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (auto ep : {dsv3::server::Endpoint::kChat, dsv3::server::Endpoint::kCompletion}) {
    try {
      check(dsv3::server::parse_api_request(text, ep), text);
    } catch (const dsv3::server::ApiError& e) {
      require(e.status == 400);
    }
  }
  return 0;
}
