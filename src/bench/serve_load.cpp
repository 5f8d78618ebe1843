#include "bench/serve_load.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/status.h"

namespace nibble {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One HTTP/1.1 exchange on a fresh connection; on_data gets the body as it arrives (de-chunked).
class Connection {
 public:
  Connection(const std::string& host, int port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    NIBBLE_CHECK(::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0 && res,
                 "cannot resolve {}", host);
    fd_ = ::socket(res->ai_family, res->ai_socktype, 0);
    const bool ok = fd_ >= 0 && ::connect(fd_, res->ai_addr, res->ai_addrlen) == 0;
    ::freeaddrinfo(res);
    NIBBLE_CHECK(ok, "cannot connect to {}:{}", host, port);
    timeval tv{300, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~Connection() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Returns the status; the body goes to on_data in pieces.
  template <typename F>
  int exchange(const std::string& request, F&& on_data) {
    NIBBLE_CHECK(::send(fd_, request.data(), request.size(), MSG_NOSIGNAL) == ssize_t(request.size()),
                 "the server closed the connection");
    std::string buf, headers;
    char tmp[16384];
    bool chunked = false, in_body = false;
    int status = 0;
    size_t chunk_left = 0;
    bool chunk_size_pending = true;
    while (true) {
      const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n <= 0) break;
      buf.append(tmp, size_t(n));
      if (!in_body) {
        const size_t end = buf.find("\r\n\r\n");
        if (end == std::string::npos) continue;
        headers = buf.substr(0, end);
        status = std::atoi(headers.c_str() + 9);
        chunked = headers.find("Transfer-Encoding: chunked") != std::string::npos;
        buf.erase(0, end + 4);
        in_body = true;
      }
      if (!chunked) {
        on_data(buf);
        buf.clear();
        continue;
      }
      while (true) {  // chunked: size line, data, CRLF
        if (chunk_size_pending) {
          const size_t eol = buf.find("\r\n");
          if (eol == std::string::npos) break;
          chunk_left = std::stoul(buf.substr(0, eol), nullptr, 16);
          buf.erase(0, eol + 2);
          chunk_size_pending = false;
          if (chunk_left == 0) return status;
        }
        if (buf.size() < chunk_left + 2) break;
        on_data(buf.substr(0, chunk_left));
        buf.erase(0, chunk_left + 2);
        chunk_size_pending = true;
      }
    }
    return status;
  }

 private:
  int fd_ = -1;
};

std::string make_request(const std::string& method, const std::string& host, const std::string& path,
                         const std::string& body, const std::string& api_key) {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n";
  if (!api_key.empty()) r += "Authorization: Bearer " + api_key + "\r\n";
  if (!body.empty()) r += "Content-Type: application/json\r\n";
  r += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  return r;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double at = p / 100 * double(v.size() - 1);
  const size_t lo = size_t(at);
  const double frac = at - double(lo);
  return lo + 1 < v.size() ? v[lo] * (1 - frac) + v[lo + 1] * frac : v[lo];
}

// Words for prompts: code-ish and English, so any tokenizer makes a few tokens of each.
const char* const kWords[] = {"def",    "return", "value",  "parser", "token",  "while", "index",  "buffer",
                              "stream", "class",  "import", "from",   "yield",  "result", "error", "count",
                              "the",    "model",  "server", "request", "memory", "block", "cache", "layer",
                              "expert", "route",  "window", "signal", "vector", "matrix", "queue", "thread"};

std::string random_prompt(std::mt19937_64& rng, int64_t words) {
  std::string p;
  for (int64_t i = 0; i < words; ++i) {
    if (i) p += (i % 12 == 0) ? "\n" : " ";
    p += kWords[rng() % std::size(kWords)];
  }
  return p;
}

double metric_value(const std::string& metrics, const std::string& name) {
  const size_t p = metrics.find("\n" + name + " ");
  if (p == std::string::npos) return -1;
  return std::atof(metrics.c_str() + p + name.size() + 2);
}

}  // namespace

std::string http_get(const std::string& host, int port, const std::string& path, const std::string& api_key) {
  Connection c(host, port);
  std::string body;
  const int status = c.exchange(make_request("GET", host, path, "", api_key), [&](const std::string& d) { body += d; });
  NIBBLE_CHECK(status == 200, "GET {}: status {}: {}", path, status, body.substr(0, 200));
  return body;
}

ServeLoadLevel run_serve_load(const ServeLoadOptions& o, int64_t concurrency) {
  NIBBLE_CHECK(concurrency >= 1, "concurrency must be at least 1");
  std::string model = o.model;
  if (model.empty()) model = json::parse(http_get(o.host, o.port, "/v1/models", o.api_key))["data"][0]["id"];
  const int64_t total = o.duration_s > 0 ? INT64_MAX : (o.requests > 0 ? o.requests : std::max<int64_t>(8, 2 * concurrency));
  std::atomic<int64_t> next{0};
  std::mutex mu;
  ServeLoadLevel level;
  level.concurrency = concurrency;
  std::vector<double> ttft, itl, e2e, rates;
  const auto t_start = Clock::now();
  const auto deadline = t_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  auto client = [&](int64_t c) {
    (void)c;
    while (true) {
      if (o.duration_s > 0 && Clock::now() >= deadline) return;
      const int64_t i = next++;
      if (i >= total) return;
      // Each request its own prompt (no shared prefix beyond chance), the same on every run.
      std::mt19937_64 rng(o.seed * 1000003 + uint64_t(i) + uint64_t(concurrency) * 7919);
      const json body = {{"model", model},
                         {"prompt", random_prompt(rng, o.prompt_words)},
                         {"max_tokens", o.max_tokens},
                         {"ignore_eos", true},
                         {"temperature", 0},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
      std::vector<double> gaps;
      double first = -1;
      int64_t prompt_tokens = 0, output_tokens = 0;
      std::string pending, error;
      const auto t0 = Clock::now();
      auto last = t0;
      int status = 0;
      try {
        Connection conn(o.host, o.port);
        status = conn.exchange(make_request("POST", o.host, "/v1/completions", body.dump(), o.api_key),
                               [&](const std::string& d) {
          pending += d;
          size_t e;
          while ((e = pending.find("\n\n")) != std::string::npos) {
            const std::string event = pending.substr(0, e);
            pending.erase(0, e + 2);
            if (event.rfind("data: ", 0) != 0) {
              if (error.empty()) error = event.substr(0, 200);
              continue;
            }
            const std::string data = event.substr(6);
            if (data == "[DONE]") continue;
            const json j = json::parse(data, nullptr, false);
            if (j.is_discarded() || j.contains("error")) {
              if (error.empty()) error = data.substr(0, 200);
              continue;
            }
            if (j.contains("usage") && !j["usage"].is_null()) {
              prompt_tokens = j["usage"]["prompt_tokens"];
              output_tokens = j["usage"]["completion_tokens"];
            }
            if (j["choices"].empty()) continue;
            const auto now = Clock::now();
            if (first < 0)
              first = std::chrono::duration<double>(now - t0).count();
            else
              gaps.push_back(std::chrono::duration<double>(now - last).count());
            last = now;
          }
        });
        if (status != 200 && error.empty()) error = "status " + std::to_string(status) + ": " + pending.substr(0, 200);
        if (status == 200 && output_tokens != o.max_tokens && error.empty())
          error = "got " + std::to_string(output_tokens) + " tokens of " + std::to_string(o.max_tokens);
      } catch (const std::exception& ex) {
        error = ex.what();
      }
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      std::lock_guard lock(mu);
      ++level.requests;
      if (!error.empty()) {
        if (level.errors++ == 0) level.first_error = error;
        continue;
      }
      level.prompt_tokens += prompt_tokens;
      level.output_tokens += output_tokens;
      ttft.push_back(first);
      e2e.push_back(seconds);
      itl.insert(itl.end(), gaps.begin(), gaps.end());
      if (output_tokens > 1 && seconds > first) rates.push_back(double(output_tokens - 1) / (seconds - first));
    }
  };
  std::vector<std::thread> threads;
  for (int64_t c = 0; c < concurrency; ++c) threads.emplace_back(client, c);
  for (auto& t : threads) t.join();
  level.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  level.output_tok_s = double(level.output_tokens) / level.seconds;
  level.ttft_p50 = percentile(ttft, 50);
  level.ttft_p99 = percentile(ttft, 99);
  level.itl_p50 = percentile(itl, 50);
  level.itl_p99 = percentile(itl, 99);
  level.e2e_p50 = percentile(e2e, 50);
  level.request_tok_s_p50 = percentile(rates, 50);
  try {
    const std::string m = http_get(o.host, o.port, "/metrics", o.api_key);
    level.server_rss_bytes = metric_value(m, "process_resident_memory_bytes");
    level.kv_blocks_used = metric_value(m, "nibble_kv_cache_blocks_used");
    level.kv_blocks_total = metric_value(m, "nibble_kv_cache_blocks_total");
  } catch (const Error&) {
  }
  return level;
}

}  // namespace nibble
