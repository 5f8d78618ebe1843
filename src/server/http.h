// A small HTTP/1.1 server on POSIX sockets for the OpenAI-compatible API: keep-alive, bodies by
// Content-Length (with a size limit), plain responses, and streamed responses in chunked transfer
// encoding (Server-Sent Events) that report a client which went away, so its request is
// cancelled. A thread per connection; the engine, not the HTTP layer, is the bottleneck.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace nibble {

struct HttpRequest {
  std::string method, path, query;
  std::map<std::string, std::string> headers;  // names lowercased
  std::string body;
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

class HttpResponse {
 public:
  explicit HttpResponse(int fd) : fd_(fd) {}
  // A complete response with a body.
  void send(int status, const std::string& content_type, const std::string& body);
  // A streamed response: headers now, then chunks; false once the client is gone.
  bool start_stream(int status, const std::string& content_type);
  bool write_chunk(const std::string& data);
  void end_stream();
  // Whether the peer closed its side (checked without blocking).
  bool client_gone() const;
  bool sent() const { return sent_; }
  bool keep_alive = true;

 private:
  bool write_all(const std::string& data);
  int fd_;
  bool sent_ = false, streaming_ = false, broken_ = false;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  size_t max_body_bytes = 32 << 20;
  size_t max_header_bytes = 64 << 10;
  int max_connections = 512;
  int read_timeout_s = 300;  // an idle keep-alive connection is closed after this
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();
  // Binds and listens; throws nibble::Error naming the address when it cannot. Returns the port
  // (useful with port 0).
  int bind();
  // Accepts connections until a stop is requested; each is served on its own thread.
  void run();
  // Async-signal-safe: run() returns within ~0.2 s.
  void request_stop() { stopping_ = true; }
  // Stops accepting, disconnects every client and waits for their threads to finish (a client's
  // running request is cancelled as for any client that goes away).
  void stop();

 private:
  void serve_connection(int fd);
  HttpServerOptions options_;
  HttpHandler handler_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::mutex fds_mu_;
  std::set<int> fds_;  // open client connections
};

const char* http_reason(int status);

}  // namespace nibble
