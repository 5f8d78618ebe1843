#include "server/reasoning.h"

#include "runtime/generate.h"

namespace nibble {

ReasoningParser::ReasoningParser(bool starts_in_reasoning, std::string open, std::string close)
    : state_(starts_in_reasoning ? kReasoning : kStart), open_(std::move(open)), close_(std::move(close)) {}

OutputSplitter::Delta ReasoningParser::push(std::string_view text) {
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

OutputSplitter::Delta ReasoningParser::flush() {
  Delta d;
  (state_ == kReasoning ? d.reasoning : d.content) += held_;
  held_.clear();
  return d;
}

namespace {

const std::string kMarkers[] = {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                "<|return|>", "<|call|>"};
// A header that long without <|message|> is not a header: the model is not writing harmony.
constexpr size_t kMaxHeader = 256;

// The first marker in `text` at or after `from`: its position and length (npos when none).
std::pair<size_t, size_t> find_marker(std::string_view text, size_t from = 0) {
  std::pair<size_t, size_t> best{std::string_view::npos, 0};
  for (const std::string& m : kMarkers) {
    const size_t at = text.find(m, from);
    if (at < best.first) best = {at, m.size()};
  }
  return best;
}

// The word after `key` in a header ("analysis" after "<|channel|>", "functions.f" after "to=").
std::string header_word(std::string_view header, std::string_view key) {
  const size_t at = header.find(key);
  if (at == std::string_view::npos) return {};
  const size_t start = at + key.size();
  size_t end = start;
  while (end < header.size() && header[end] != ' ' && header[end] != '<' && header[end] != '\n') ++end;
  return std::string(header.substr(start, end - start));
}

}  // namespace

void HarmonyParser::emit(Delta& d, std::string_view text) {
  if (text.empty()) return;
  switch (target_) {
    case kReasoning: d.reasoning += text; break;
    case kContent: d.content += text; break;
    case kToolCall:
      if (d.tool_calls.empty() || d.tool_calls.back().index != tool_calls_ - 1)
        d.tool_calls.push_back({tool_calls_ - 1, "", ""});
      d.tool_calls.back().arguments += text;
      break;
    case kDropped: break;
  }
}

void HarmonyParser::open_message(Delta& d) {
  const std::string channel = header_word(header_, "<|channel|>");
  const std::string recipient = header_word(header_, "to=");
  header_.clear();
  state_ = kBody;
  if (recipient.starts_with("functions.")) {
    target_ = kToolCall;
    d.tool_calls.push_back({tool_calls_++, recipient.substr(10), ""});
  } else if (!recipient.empty()) {
    target_ = kDropped;  // a built-in tool's call (browser, python): not a function the client offered
  } else {
    target_ = channel == "analysis" ? kReasoning : kContent;
  }
}

OutputSplitter::Delta HarmonyParser::push(std::string_view text) {
  Delta d;
  held_ += text;
  while (!held_.empty()) {
    auto [at, len] = find_marker(held_);
    if (state_ == kBody) {
      if (at == std::string::npos) {  // all of it but a possible marker's start
        const size_t keep = partial_match_suffix(held_, kMarkers);
        emit(d, std::string_view(held_).substr(0, held_.size() - keep));
        held_.erase(0, held_.size() - keep);
        return d;
      }
      emit(d, std::string_view(held_).substr(0, at));
      const std::string_view marker = std::string_view(held_).substr(at, len);
      if (marker == "<|end|>" || marker == "<|return|>" || marker == "<|call|>" || marker == "<|start|>") {
        state_ = kHeader;
        header_.clear();
      } else {
        emit(d, marker);  // a marker inside a body (the model quoting one) is text
      }
      held_.erase(0, at + len);
      continue;
    }
    // Header: everything up to <|message|>.
    const size_t msg = held_.find("<|message|>");
    if (msg != std::string::npos) {
      header_ += held_.substr(0, msg);
      held_.erase(0, msg + 11);
      open_message(d);
      continue;
    }
    const size_t keep = partial_match_suffix(held_, kMarkers);
    header_ += held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    if (header_.size() > kMaxHeader) {  // not harmony: what was taken for a header is content
      target_ = kContent;
      state_ = kBody;
      emit(d, header_);
      header_.clear();
    }
    return d;
  }
  return d;
}

OutputSplitter::Delta HarmonyParser::flush() {
  Delta d;
  if (state_ == kBody) {
    emit(d, held_);
  } else {
    // An unfinished header: text without harmony markers is the model answering plainly.
    std::string rest = header_ + held_;
    if (rest.find("<|") == std::string::npos && rest.find("to=") == std::string::npos) d.content += rest;
  }
  held_.clear();
  header_.clear();
  return d;
}

}  // namespace nibble
