// `nibble serve` in process on the bundled model (CPU), driven over real sockets: the routes,
// chat and completions with and without streaming, greedy agreement between endpoints, seeded
// sampling, stop strings, usage, concurrency (clients at once get what they get one at a time),
// bad requests with OpenAI-shaped errors, the API key, and a client that disconnects mid-stream
// (its generation is cancelled and the server goes on).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/status.h"
#include "model/model.h"
#include "runtime/generate.h"
#include "server/openai_server.h"

namespace nibble {
namespace {

using json = nlohmann::json;

struct Reply {
  int status = 0;
  std::string headers, body;  // body de-chunked
  json j() const { return json::parse(body); }
};

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

Reply parse_reply(const std::string& raw) {
  Reply r;
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return r;
  r.headers = raw.substr(0, end);
  r.status = std::stoi(raw.substr(9, 3));
  std::string body = raw.substr(end + 4);
  if (r.headers.find("Transfer-Encoding: chunked") != std::string::npos) {
    size_t p = 0;
    while (p < body.size()) {
      const size_t eol = body.find("\r\n", p);
      const size_t n = std::stoul(body.substr(p, eol - p), nullptr, 16);
      if (n == 0) break;
      r.body += body.substr(eol + 2, n);
      p = eol + 2 + n + 2;
    }
  } else {
    r.body = body;
  }
  return r;
}

Reply request(int port, const std::string& method, const std::string& path, const std::string& body = "",
              const std::string& extra_headers = "") {
  const int fd = connect_to(port);
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra_headers +
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string raw;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) raw.append(buf, size_t(n));
  ::close(fd);
  return parse_reply(raw);
}

Reply post(int port, const std::string& path, const json& body, const std::string& headers = "") {
  return request(port, "POST", path, body.dump(), headers);
}

// The SSE events of a streamed reply, without the [DONE] marker (which must be last).
std::vector<json> events(const Reply& r) {
  std::vector<json> out;
  size_t p = 0;
  bool done = false;
  while ((p = r.body.find("data: ", p)) != std::string::npos) {
    const size_t e = r.body.find("\n\n", p);
    const std::string data = r.body.substr(p + 6, e - p - 6);
    EXPECT_FALSE(done) << "event after [DONE]";
    if (data == "[DONE]")
      done = true;
    else
      out.push_back(json::parse(data));
    p = e;
  }
  EXPECT_TRUE(done) << r.body;
  return out;
}

// A counter or gauge from /metrics.
double metric(int port, const std::string& name) {
  const std::string m = request(port, "GET", "/metrics").body;
  const size_t p = m.find("\n" + name + " ");
  EXPECT_NE(p, std::string::npos) << name;
  return p == std::string::npos ? -1 : std::stod(m.substr(p + name.size() + 2));
}

// A server of its own on the bundled model.
struct OwnServer {
  explicit OwnServer(ServeOptions o) : server(prepared(std::move(o))) {
    port = server.bind();
    thread = std::thread([this] { server.run(); });
  }
  ~OwnServer() {
    server.stop();
    thread.join();
  }
  static ServeOptions prepared(ServeOptions o) {
    o.model_dir = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
    o.served_model_name = "tiny";
    o.port = 0;
    return o;
  }
  OpenAiServer server;
  int port = 0;
  std::thread thread;
};

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServeOptions o;
    o.model_dir = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
    o.served_model_name = "tiny";
    o.port = 0;
    o.api_key = "";
    server_ = new OpenAiServer(o);
    port_ = server_->bind();
    thread_ = new std::thread([] { server_->run(); });
  }
  static void TearDownTestSuite() {
    server_->stop();
    thread_->join();
    delete thread_;
    delete server_;
  }
  static json chat(const std::string& content, json extra = json::object()) {
    json b = {{"model", "tiny"},
              {"messages", {{{"role", "user"}, {"content", content}}}},
              {"max_tokens", 16},
              {"temperature", 0}};
    b.update(extra);
    return b;
  }
  static inline OpenAiServer* server_ = nullptr;
  static inline std::thread* thread_ = nullptr;
  static inline int port_ = 0;
};

TEST_F(ServerTest, HealthModelsAndRoutes) {
  EXPECT_EQ(request(port_, "GET", "/health").status, 200);
  Reply m = request(port_, "GET", "/v1/models");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(m.j()["data"][0]["id"], "tiny");
  EXPECT_EQ(m.j()["data"][0]["max_model_len"], 2048);
  EXPECT_EQ(request(port_, "GET", "/v1/nothing").status, 404);
  EXPECT_EQ(request(port_, "GET", "/v1/chat/completions").status, 405);
}

TEST_F(ServerTest, ChatGreedyEqualsCompletionOfTheRenderedPrompt) {
  Reply c = post(port_, "/v1/chat/completions", chat("Reverse a string."));
  ASSERT_EQ(c.status, 200) << c.body;
  const json j = c.j();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["usage"]["completion_tokens"], 16);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  const std::string chatml =
      "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n"
      "Reverse a string.<|im_end|>\n<|im_start|>assistant\n";
  Reply p = post(port_, "/v1/completions", {{"prompt", chatml}, {"max_tokens", 16}, {"temperature", 0}});
  ASSERT_EQ(p.status, 200) << p.body;
  EXPECT_EQ(p.j()["choices"][0]["text"], j["choices"][0]["message"]["content"]);
  EXPECT_EQ(p.j()["usage"]["prompt_tokens"], j["usage"]["prompt_tokens"]);
}

TEST_F(ServerTest, StreamingDeltasAddUpToTheWholeAnswer) {
  const json whole = post(port_, "/v1/chat/completions", chat("Write a loop.")).j();
  Reply s = post(port_, "/v1/chat/completions",
                 chat("Write a loop.", {{"stream", true}, {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(s.status, 200);
  EXPECT_NE(s.headers.find("text/event-stream"), std::string::npos);
  std::string text;
  std::string finish;
  json usage;
  for (const json& e : events(s)) {
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    if (!e["usage"].is_null()) usage = e["usage"];
    if (e["choices"].empty()) continue;
    const json& d = e["choices"][0]["delta"];
    if (d.contains("content")) text += d["content"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, whole["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(usage["completion_tokens"], 16);
}

TEST_F(ServerTest, SeedsStopStringsAndN) {
  const json sampled = chat("Write a class.", {{"temperature", 0.9}, {"seed", 11}, {"max_tokens", 24}});
  EXPECT_EQ(post(port_, "/v1/chat/completions", sampled).j()["choices"][0]["message"]["content"],
            post(port_, "/v1/chat/completions", sampled).j()["choices"][0]["message"]["content"]);
  const json two =
      post(port_, "/v1/chat/completions", chat("Write a class.", {{"temperature", 0.9}, {"seed", 11}, {"n", 2}})).j();
  ASSERT_EQ(two["choices"].size(), 2u);
  EXPECT_EQ(two["choices"][1]["index"], 1);
  Reply stop = post(port_, "/v1/completions",
                    {{"prompt", "def fib(n):"}, {"max_tokens", 40}, {"temperature", 0}, {"stop", "\n"}});
  ASSERT_EQ(stop.status, 200) << stop.body;
  EXPECT_EQ(stop.j()["choices"][0]["text"].get<std::string>().find('\n'), std::string::npos);
  EXPECT_EQ(stop.j()["choices"][0]["finish_reason"], "stop");
  Reply lp =
      post(port_, "/v1/chat/completions", chat("hi", {{"logprobs", true}, {"top_logprobs", 3}, {"max_tokens", 4}}));
  ASSERT_EQ(lp.status, 200) << lp.body;
  const json lpj = lp.j();
  const json& content = lpj["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  EXPECT_EQ(content[0]["top_logprobs"].size(), 3u);
  EXPECT_LE(content[0]["logprob"].get<double>(), 0.0);
}

TEST_F(ServerTest, ClientsAtOnceGetWhatTheyGetOneAtATime) {
  std::vector<std::string> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back("Task number " + std::to_string(i));
  std::vector<std::string> alone;
  for (auto& p : prompts)
    alone.push_back(post(port_, "/v1/chat/completions", chat(p)).j()["choices"][0]["message"]["content"]);
  std::vector<std::future<std::string>> together;
  for (auto& p : prompts)
    together.push_back(std::async(std::launch::async, [&, p] {
      return post(port_, "/v1/chat/completions", chat(p)).j()["choices"][0]["message"]["content"].get<std::string>();
    }));
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(together[i].get(), alone[i]) << prompts[i];
  // Every block is back in the pool (cached prefixes are free blocks too).
  EXPECT_EQ(metric(port_, "nibble_kv_cache_blocks_used"), 0);
  EXPECT_EQ(metric(port_, "nibble_num_requests_running"), 0);
}

TEST_F(ServerTest, BadRequestsGetOpenAiErrors) {
  struct Bad {
    std::string body;
    int status;
    const char* says;
  };
  const std::string long_prompt(20000, 'x');
  const Bad cases[] = {
      {"{not json", 400, "not valid JSON"},
      {"[]", 400, "JSON object"},
      {chat("x", {{"model", "other"}}).dump(), 404, "does not exist"},
      {chat("x", {{"max_tokens", 0}}).dump(), 400, "at least 1"},
      {chat("x", {{"max_tokens", 100000000}}).dump(), 400, "maximum context length"},
      {chat(long_prompt).dump(), 400, "maximum context length"},
      {chat("x", {{"temperature", "hot"}}).dump(), 400, "temperature"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}", 400, "UTF-8"},
  };
  for (const Bad& b : cases) {
    Reply r = request(port_, "POST", "/v1/chat/completions", b.body);
    EXPECT_EQ(r.status, b.status) << b.body.substr(0, 80) << " -> " << r.body;
    ASSERT_FALSE(r.body.empty());
    const json e = r.j()["error"];
    EXPECT_NE(e["message"].get<std::string>().find(b.says), std::string::npos) << r.body;
    EXPECT_EQ(e["code"], b.status);
  }
  Reply oov = post(port_, "/v1/completions", {{"prompt", {5, 999999}}, {"max_tokens", 1}});
  EXPECT_EQ(oov.status, 400);
  EXPECT_NE(oov.body.find("outside the vocabulary"), std::string::npos) << oov.body;
  Reply big = request(port_, "POST", "/v1/completions", std::string(40 << 20, ' '));
  EXPECT_EQ(big.status, 413);
  // The server still answers after all that.
  EXPECT_EQ(post(port_, "/v1/completions", {{"prompt", "a"}, {"max_tokens", 1}}).status, 200);
}

// Continuous batching: a short request sent while a long one is generating finishes first.
TEST_F(ServerTest, AShortRequestDoesNotWaitForALongOne) {
  using Clock = std::chrono::steady_clock;
  auto long_done = std::async(std::launch::async, [&] {
    post(port_, "/v1/chat/completions", chat("Write a long module.", {{"max_tokens", 600}, {"ignore_eos", true}}));
    return Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Reply short_reply = post(port_, "/v1/chat/completions", chat("hi", {{"max_tokens", 2}}));
  const auto short_done = Clock::now();
  ASSERT_EQ(short_reply.status, 200);
  EXPECT_LT(short_done, long_done.get());
}

TEST_F(ServerTest, DisconnectMidStreamCancelsTheGeneration) {
  auto cancelled = [&] {
    const std::string m = request(port_, "GET", "/metrics").body;
    const size_t p = m.find("\nnibble_request_cancelled_total ");
    return std::stoll(m.substr(p + 32));
  };
  const int64_t before = cancelled();
  const int fd = connect_to(port_);
  const std::string body =
      chat("Write a long module.", {{"stream", true}, {"max_tokens", 1900}, {"ignore_eos", true}}).dump();
  const std::string req =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
      body;
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  char buf[4096];
  ASSERT_GT(::recv(fd, buf, sizeof buf, 0), 0);  // the stream has started
  ::close(fd);
  const auto t0 = std::chrono::steady_clock::now();
  while (cancelled() == before && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cancelled(), before + 1);
  // Well before 1,900 tokens would have taken, the next request is served.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(post(port_, "/v1/completions", {{"prompt", "a"}, {"max_tokens", 1}}).status, 200);
}

// Prefix caching: a request whose prompt starts with an earlier one's takes that prompt's KV
// blocks (whole blocks of 16) instead of computing them, reports them in
// usage.prompt_tokens_details.cached_tokens and the metrics, and answers exactly what a server
// without prefix caching answers.
TEST(ServerPrefixCaching, ASharedPrefixIsNotComputedAgain) {
  std::string document = "# Notes on the parser module\n";
  for (int i = 0; i < 12; ++i) document += "def rule_" + std::to_string(i) + "(tokens):\n    return parse(tokens)\n";
  auto ask = [&](int port, const std::string& question) {
    return post(port, "/v1/completions",
                {{"model", "tiny"}, {"prompt", document + question}, {"max_tokens", 12}, {"temperature", 0}})
        .j();
  };
  ServeOptions with, without;
  without.enable_prefix_caching = false;
  OwnServer cached(with), plain(without);
  const json first = ask(cached.port, "def main():");
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json second = ask(cached.port, "class Parser:");
  const int64_t n_prompt = second["usage"]["prompt_tokens"], hit = second["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GE(hit, 96) << "the shared document is " << n_prompt << " tokens";
  EXPECT_LT(hit, n_prompt);
  EXPECT_EQ(hit % 16, 0);
  EXPECT_EQ(metric(cached.port, "nibble_prefix_cache_hits_total"), double(hit));
  EXPECT_GE(metric(cached.port, "nibble_prefix_cache_queries_total"), double(2 * n_prompt - 20));
  // The same request again: everything but the last token comes from the cache.
  const json third = ask(cached.port, "class Parser:");
  EXPECT_EQ(third["usage"]["prompt_tokens_details"]["cached_tokens"], (n_prompt - 1) / 16 * 16);
  const json reference = (ask(plain.port, "def main():"), ask(plain.port, "class Parser:"));
  EXPECT_EQ(reference["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(second["choices"][0]["text"], reference["choices"][0]["text"]);
  EXPECT_EQ(third["choices"][0]["text"], reference["choices"][0]["text"]);
  EXPECT_EQ(metric(plain.port, "nibble_prefix_cache_hits_total"), 0);
}

// gpt-oss served (the tiny MXFP4 fixture with gpt-oss's harmony template): the harmony parser is
// picked (reasoning_content in the message), reasoning_effort and an OpenAI-style tool-call turn
// render, a bad effort is a 400, and a prefix-cache hit over sliding-window layers gives what the
// uncached server gives (the window's keys of the cached prefix are in the cache).
TEST(ServerGptOss, HarmonyToolTurnsAndPrefixCaching) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("nibble_server_gpt_oss_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (auto& f : fs::directory_iterator(std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-gpt-oss-mxfp4"))
    fs::copy_file(f.path(), dir / f.path().filename(), fs::copy_options::overwrite_existing);
  fs::copy_file(std::string(NIBBLE_FIXTURES_DIR) + "/chat_templates/gpt-oss.jinja", dir / "chat_template.jinja",
                fs::copy_options::overwrite_existing);
  auto serve = [&](bool caching) {
    ServeOptions o;
    o.model_dir = dir.string();
    o.served_model_name = "gpt-oss";
    o.port = 0;
    o.max_model_len = 1024;
    o.enable_prefix_caching = caching;
    return std::make_unique<OpenAiServer>(o);
  };
  struct Running {
    std::unique_ptr<OpenAiServer> server;
    int port;
    std::thread thread;
    ~Running() {
      server->stop();
      thread.join();
    }
  };
  auto start = [&](bool caching) {
    auto r = std::make_unique<Running>();
    r->server = serve(caching);
    r->port = r->server->bind();
    r->thread = std::thread([s = r->server.get()] { s->run(); });
    return r;
  };
  auto cached = start(true), plain = start(false);
  const json turn = json::parse(R"([{"role": "user", "content": "Weather in Oslo?"},
      {"role": "assistant", "content": null, "reasoning_content": "Use the tool.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny, 18 C"}])");
  auto chat = [&](int port, const json& messages) {
    return post(port, "/v1/chat/completions",
                {{"messages", messages}, {"max_tokens", 6}, {"temperature", 0}, {"reasoning_effort", "high"}});
  };
  Reply first = chat(cached->port, turn);
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_TRUE(first.j()["choices"][0]["message"].contains("reasoning_content")) << first.body;
  // The same conversation again hits the prefix cache; the answer is the uncached server's.
  Reply again = chat(cached->port, turn), reference = chat(plain->port, turn);
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_GT(again.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 100);
  EXPECT_EQ(again.j()["choices"][0]["message"], reference.j()["choices"][0]["message"]);
  Reply bad = post(cached->port, "/v1/chat/completions",
                   {{"messages", turn}, {"max_tokens", 2}, {"reasoning_effort", "maximal"}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("reasoning_effort"), std::string::npos) << bad.body;
  cached.reset();
  plain.reset();
  fs::remove_all(dir);
}

// A KV cache too small for everyone at once: sequences are preempted (their blocks freed) and
// recomputed later instead of failing, each still gets what it gets alone, and the pool is whole
// again at the end.
TEST(ServerPreemption, RunningOutOfBlocksPreemptsAndRecomputes) {
  ServeOptions o;
  o.max_model_len = 256;                     // 16 blocks of 16 per sequence at most
  o.kv_cache_memory_bytes = 21 * 32768;      // 20 usable blocks of 32 KiB (4 layers, 2 KV heads of 64, f16)
  o.max_num_seqs = 6;
  OwnServer server(o);
  EXPECT_EQ(metric(server.port, "nibble_kv_cache_blocks_total"), 20);
  auto body = [](int i) {
    return json{{"model", "tiny"},
                {"prompt", "# task " + std::to_string(i) + "\ndef solve_" + std::to_string(i) + "(data):"},
                {"max_tokens", 150},
                {"ignore_eos", true},
                {"temperature", 0}};
  };
  std::vector<std::string> alone;
  for (int i = 0; i < 6; ++i) alone.push_back(post(server.port, "/v1/completions", body(i)).j()["choices"][0]["text"]);
  EXPECT_EQ(metric(server.port, "nibble_num_preemptions_total"), 0);
  std::vector<std::future<json>> together;
  for (int i = 0; i < 6; ++i)
    together.push_back(std::async(std::launch::async, [&, i] { return post(server.port, "/v1/completions", body(i)).j(); }));
  for (int i = 0; i < 6; ++i) {
    const json r = together[size_t(i)].get();
    EXPECT_EQ(r["choices"][0]["text"], alone[size_t(i)]) << i;
    EXPECT_EQ(r["usage"]["completion_tokens"], 150);
  }
  EXPECT_GT(metric(server.port, "nibble_num_preemptions_total"), 0);
  EXPECT_EQ(metric(server.port, "nibble_kv_cache_blocks_used"), 0);
}

TEST(ServerKvCache, BadSizesAreRefusedAtStart) {
  ServeOptions o = OwnServer::prepared({});
  o.max_model_len = 2048;
  o.kv_cache_memory_bytes = 10 * 32768;
  try {
    OpenAiServer s(o);
    FAIL() << "a KV cache smaller than one sequence was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--max-model-len"), std::string::npos) << e.what();
  }
  o.kv_cache_memory_bytes = 0;
  o.block_size = 24;
  try {
    OpenAiServer s(o);
    FAIL() << "block size 24 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--block-size"), std::string::npos) << e.what();
  }
}

// The bytes-for-accuracy options through the server: an E4M3 KV pool and a 4-bit lm_head. Four
// clients at once get what they get one at a time (rows of one batched step over the E4M3 pool),
// which is `nibble run`'s answer with the same options, and the pool is whole again after.
TEST(ServerKvCache, Fp8CacheAndFourBitHeadServe) {
  ServeOptions o;
  o.kv_cache_dtype = "fp8";
  o.quantize_layers = "lm_head";
  OwnServer server(o);
  auto ask = [&](int i) {
    return post(server.port, "/v1/completions",
                {{"model", "tiny"}, {"prompt", "def task_" + std::to_string(i) + "(items):"}, {"max_tokens", 20},
                 {"temperature", 0}})
        .j()["choices"][0]["text"]
        .get<std::string>();
  };
  std::vector<std::string> alone, together(4);
  for (int i = 0; i < 4; ++i) alone.push_back(ask(i));
  std::vector<std::thread> clients;
  for (int i = 0; i < 4; ++i) clients.emplace_back([&, i] { together[size_t(i)] = ask(i); });
  for (auto& c : clients) c.join();
  EXPECT_EQ(together, alone);
  EXPECT_EQ(metric(server.port, "nibble_kv_cache_blocks_used"), 0);

  auto backend = make_cpu_backend();
  LoadOptions load;
  load.kv_cache_dtype = DType::F8_E4M3;
  load.quantize_layers = {"lm_head"};
  const std::string dir = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  auto model = load_model(dir, *backend, load);
  Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  GenerateRequest req;
  req.prompt = tok.encode("def task_2(items):");
  req.max_new_tokens = 20;
  req.max_context = 256;
  req.sampling.temperature = 0;
  EXPECT_EQ(generate(*model, tok, req, [](const GeneratedToken&, std::string_view) {}).text, alone[2]);
}

TEST(ServerAuth, ApiKeyIsRequiredOnV1Routes) {
  ServeOptions o;
  o.model_dir = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  o.port = 0;
  o.api_key = "sekrit";
  OpenAiServer server(o);
  const int port = server.bind();
  std::thread t([&] { server.run(); });
  EXPECT_EQ(request(port, "GET", "/v1/models").status, 401);
  EXPECT_EQ(request(port, "GET", "/v1/models", "", "Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(request(port, "GET", "/v1/models", "", "Authorization: Bearer sekrit\r\n").status, 200);
  EXPECT_EQ(request(port, "GET", "/health").status, 200);  // health checks need no key
  // Stopping disconnects idle keep-alive clients instead of waiting for them.
  const int idle = connect_to(port);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = std::chrono::steady_clock::now();
  server.stop();
  t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  ::close(idle);
}

}  // namespace
}  // namespace nibble
