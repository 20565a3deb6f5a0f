#include "server/text_stream.h"

#include <algorithm>

namespace dsv3::server {

namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// Length of the longest tail of `s` that is a proper prefix of `tag` (what may still become it).
size_t partial_tail(std::string_view s, std::string_view tag) {
  for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
  return 0;
}

}  // namespace

std::string StopMatcher::push(std::string_view text) {
  if (matched_) return {};
  held_ += text;
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    std::string out = held_.substr(0, first);
    held_.clear();
    matched_ = true;
    return out;
  }
  size_t keep = 0;
  for (const std::string& s : stops_) keep = std::max(keep, partial_tail(held_, s));
  // A held tail is a prefix of a (valid UTF-8) stop string, so the cut is at a character boundary.
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

TextDelta ReasoningSplitter::push(std::string_view text) {
  held_ += text;
  TextDelta out;
  for (;;) {
    if (reasoning_) {
      const size_t close = held_.find(kClose);
      if (close != std::string::npos) {
        out.reasoning += held_.substr(0, close);
        held_.erase(0, close + kClose.size());
        reasoning_ = false;
        after_close_ = true;
        continue;
      }
      const size_t keep = partial_tail(held_, kClose);
      out.reasoning += held_.substr(0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    if (after_close_) {
      const size_t start = held_.find_first_not_of("\r\n");
      if (start == std::string::npos) {
        held_.clear();
        return out;
      }
      held_.erase(0, start);
      after_close_ = false;
    }
    if (at_start_) {
      size_t ws = 0;
      while (ws < held_.size() && is_space(held_[ws])) ++ws;
      if (ws == held_.size()) return out;  // only whitespace yet: a <think> may follow
      std::string_view rest = std::string_view(held_).substr(ws);
      if (rest.substr(0, kOpen.size()) == kOpen) {
        held_.erase(0, ws + kOpen.size());
        reasoning_ = saw_reasoning_ = true;
        at_start_ = false;
        continue;
      }
      if (rest.size() < kOpen.size() && kOpen.substr(0, rest.size()) == rest) return out;  // "<thi" ...
      at_start_ = false;
    }
    out.content += held_;
    held_.clear();
    return out;
  }
}

TextDelta ReasoningSplitter::flush() {
  TextDelta out;
  (reasoning_ ? out.reasoning : out.content) = held_;
  if (after_close_) out.content.clear();  // only the newlines after </think>
  held_.clear();
  return out;
}

ChoiceText::ChoiceText(const Tokenizer& tok, const ChoiceTextOptions& opt)
    : decoder_(tok, true), stop_(opt.stop), split_(opt.split_reasoning),
      splitter_(opt.split_reasoning && opt.prompt_opens_reasoning) {}

TextDelta ChoiceText::route(const std::string& text) {
  if (split_) return splitter_.push(text);
  TextDelta d;
  d.content = text;
  return d;
}

TextDelta ChoiceText::push(int32_t id) {
  if (stop_.matched()) return {};
  return route(stop_.push(decoder_.push(id)));
}

TextDelta ChoiceText::finish() {
  std::string tail = decoder_.flush();
  std::string text;
  if (!stop_.matched()) {
    text = stop_.push(tail);
    if (!stop_.matched()) text += stop_.flush();
  }
  TextDelta d = route(text);
  if (split_) d.append(splitter_.flush());
  return d;
}

bool prompt_opens_reasoning(std::string_view prompt) {
  size_t end = prompt.size();
  while (end > 0 && is_space(prompt[end - 1])) --end;
  return end >= kOpen.size() && prompt.substr(end - kOpen.size(), kOpen.size()) == kOpen;
}

}  // namespace dsv3::server
