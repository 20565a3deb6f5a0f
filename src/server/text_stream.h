// The text of one choice, built token by token as the engine streams it: incremental
// detokenization (never a broken UTF-8 character), stop strings (the matched text and all after
// it dropped; text that may be the start of a stop string held back until it is known not to
// be), and the split of thinking models' output (DeepSeek-R1, V3.1) into reasoning (between
// <think> and </think>) and content.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace dsv3::server {

// Finds stop strings in streamed text. push() returns the text that is final: everything before
// a match, or everything but a tail that a stop string could still begin with.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(std::string_view text);
  std::string flush();  // the held tail, at the end of the choice (empty after a match)
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

struct TextDelta {
  std::string reasoning, content;
  bool empty() const { return reasoning.empty() && content.empty(); }
  void append(const TextDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
  }
};

// Routes text to reasoning or content. `in_reasoning`: the prompt already opened a <think> block
// (R1's and V3.1's thinking templates end the prompt with it). Otherwise the output is content,
// unless it opens with <think> itself (after whitespace). </think> switches to content; the
// newlines right after it are dropped. Tags split over pushes are held back until complete.
class ReasoningSplitter {
 public:
  explicit ReasoningSplitter(bool in_reasoning)
      : reasoning_(in_reasoning), at_start_(!in_reasoning), saw_reasoning_(in_reasoning) {}
  TextDelta push(std::string_view text);
  TextDelta flush();
  bool saw_reasoning() const { return saw_reasoning_; }  // a <think> block opened

 private:
  std::string held_;
  bool reasoning_;
  bool at_start_;       // content so far is only whitespace: a <think> may still open
  bool after_close_ = false;  // just after </think>: leading newlines of the content are dropped
  bool saw_reasoning_ = false;
};

struct ChoiceTextOptions {
  std::vector<std::string> stop;
  bool split_reasoning = false;  // chat: reasoning_content apart from content
  bool prompt_opens_reasoning = false;
};

class ChoiceText {
 public:
  ChoiceText(const Tokenizer& tok, const ChoiceTextOptions& opt);
  TextDelta push(int32_t id);  // nothing once a stop string matched
  TextDelta finish();          // what is held back, at the end of the choice
  bool stopped() const { return stop_.matched(); }
  bool saw_reasoning() const { return split_ && splitter_.saw_reasoning(); }

 private:
  TextDelta route(const std::string& text);
  StreamDecoder decoder_;
  StopMatcher stop_;
  bool split_;
  ReasoningSplitter splitter_;
};

// Whether a rendered chat prompt leaves the model inside a <think> block: it ends with <think>
// (and whitespace).
bool prompt_opens_reasoning(std::string_view prompt);

}  // namespace dsv3::server
