#include "server/reasoning.h"

#include "runtime/generate.h"

namespace nibble {

ReasoningParser::ReasoningParser(bool starts_in_reasoning, std::string open, std::string close)
    : state_(starts_in_reasoning ? kReasoning : kStart), open_(std::move(open)), close_(std::move(close)) {}

ReasoningParser::Delta ReasoningParser::push(std::string_view text) {
  Delta d;
  held_ += text;
  while (!held_.empty()) {
    if (state_ == kStart) {
      // Leading whitespace before the open tag belongs to neither side yet.
      const size_t lead = held_.find_first_not_of(" \t\r\n");
      if (lead == std::string::npos) return d;
      std::string_view rest = std::string_view(held_).substr(lead);
      if (rest.size() < open_.size() && open_.compare(0, rest.size(), rest) == 0) return d;  // maybe the tag
      if (rest.substr(0, open_.size()) == open_) {
        held_.erase(0, lead + open_.size());
        state_ = kReasoning;
      } else {
        state_ = kContent;
      }
      continue;
    }
    if (state_ == kContent) {
      d.content += held_;
      held_.clear();
      return d;
    }
    const size_t end = held_.find(close_);
    if (end != std::string::npos) {
      d.reasoning += held_.substr(0, end);
      held_.erase(0, end + close_.size());
      state_ = kContent;
      continue;
    }
    const size_t keep = partial_match_suffix(held_, std::span<const std::string>(&close_, 1));
    d.reasoning += held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return d;
  }
  return d;
}

ReasoningParser::Delta ReasoningParser::flush() {
  Delta d;
  (state_ == kReasoning ? d.reasoning : d.content) += held_;
  held_.clear();
  return d;
}

}  // namespace nibble
