#include "server/http.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/status.h"

namespace nibble {

const char* http_reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

bool HttpResponse::write_all(const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      broken_ = true;
      return false;
    }
    off += size_t(n);
  }
  return true;
}

void HttpResponse::send(int status, const std::string& content_type, const std::string& body) {
  sent_ = true;
  write_all(fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n", status,
                        http_reason(status), content_type, body.size(), keep_alive ? "keep-alive" : "close") +
            body);
}

bool HttpResponse::start_stream(int status, const std::string& content_type) {
  sent_ = streaming_ = true;
  return write_all(
      fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nCache-Control: no-cache\r\n"
                  "Transfer-Encoding: chunked\r\nConnection: {}\r\n\r\n",
                  status, http_reason(status), content_type, keep_alive ? "keep-alive" : "close"));
}

bool HttpResponse::write_chunk(const std::string& data) {
  if (broken_) return false;
  if (data.empty()) return true;
  return write_all(fmt::format("{:x}\r\n", data.size()) + data + "\r\n");
}

void HttpResponse::end_stream() {
  if (!broken_) write_all("0\r\n\r\n");
}

bool HttpResponse::client_gone() const {
  if (broken_) return true;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0;  // orderly shutdown; data (a pipelined request) means still there
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : options_(std::move(options)), handler_(std::move(handler)) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const std::string port = std::to_string(options_.port);
  const int rc = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &res);
  NIBBLE_CHECK(rc == 0, "--host {}: {}", options_.host, gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_error = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  NIBBLE_CHECK(listen_fd_ >= 0, "cannot listen on {}:{}: {}", options_.host, options_.port, last_error);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  return addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

void HttpServer::run() {
  NIBBLE_CHECK(listen_fd_ >= 0, "HttpServer::run before bind");
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    if (connections_ >= options_.max_connections) {
      HttpResponse r(fd);
      r.keep_alive = false;
      r.send(
          503, "application/json",
          R"({"error": {"message": "too many connections", "type": "ServiceUnavailable", "param": null, "code": 503}})");
      ::close(fd);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tv{options_.read_timeout_s, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ++connections_;
    {
      std::lock_guard lock(fds_mu_);
      fds_.insert(fd);
    }
    std::thread([this, fd] {
      try {
        serve_connection(fd);
      } catch (...) {
      }
      {
        std::lock_guard lock(fds_mu_);
        fds_.erase(fd);
      }
      ::close(fd);
      --connections_;
    }).detach();
  }
}

void HttpServer::stop() {
  stopping_ = true;
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  {
    std::lock_guard lock(fds_mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);  // wakes reads; writes fail: requests cancel
  }
  for (int i = 0; i < 1000 && connections_ > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

void send_error(HttpResponse& r, int status, const std::string& message) {
  r.keep_alive = false;
  r.send(status, "application/json",
         fmt::format(R"({{"error": {{"message": "{}", "type": "BadRequestError", "param": null, "code": {}}}}})",
                     message, status));
}

}  // namespace

void HttpServer::serve_connection(int fd) {
  std::string buf;
  char chunk[16384];
  while (!stopping_) {
    // Headers.
    size_t header_end;
    while ((header_end = buf.find("\r\n\r\n")) == std::string::npos) {
      if (buf.size() > options_.max_header_bytes) {
        HttpResponse r(fd);
        send_error(r, 431, "request headers too large");
        return;
      }
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // closed, or idle past the timeout
      buf.append(chunk, size_t(n));
    }
    HttpRequest req;
    HttpResponse res(fd);
    const std::string head = buf.substr(0, header_end);
    buf.erase(0, header_end + 4);
    size_t line_end = head.find("\r\n");
    const std::string request_line = head.substr(0, line_end);
    const size_t s1 = request_line.find(' '), s2 = request_line.rfind(' ');
    if (s1 == std::string::npos || s2 == s1 || request_line.compare(s2 + 1, 5, "HTTP/") != 0) {
      send_error(res, 400, "malformed request line");
      return;
    }
    req.method = request_line.substr(0, s1);
    std::string target = request_line.substr(s1 + 1, s2 - s1 - 1);
    const size_t q = target.find('?');
    req.path = target.substr(0, q);
    if (q != std::string::npos) req.query = target.substr(q + 1);
    const bool http10 = request_line.compare(s2 + 1, 8, "HTTP/1.0") == 0;
    while (line_end != std::string::npos) {
      const size_t start = line_end + 2;
      line_end = head.find("\r\n", start);
      const std::string line = head.substr(start, line_end == std::string::npos ? std::string::npos : line_end - start);
      const size_t colon = line.find(':');
      if (colon == std::string::npos) {
        if (!line.empty()) {
          send_error(res, 400, "malformed header line");
          return;
        }
        continue;
      }
      req.headers[lower(trim(line.substr(0, colon)))] = trim(line.substr(colon + 1));
    }
    const std::string connection = lower(req.header("connection"));
    res.keep_alive = http10 ? connection == "keep-alive" : connection != "close";
    if (!req.header("transfer-encoding").empty()) {
      send_error(res, 501, "chunked request bodies are not supported; send Content-Length");
      return;
    }
    // Body.
    size_t length = 0;
    if (!req.header("content-length").empty()) {
      const std::string cl = req.header("content-length");
      if (cl.find_first_not_of("0123456789") != std::string::npos || cl.size() > 18) {
        send_error(res, 400, "bad Content-Length");
        return;
      }
      length = std::stoull(cl);
    }
    if (length > options_.max_body_bytes) {
      send_error(res, 413,
                 fmt::format("request body of {} bytes is larger than the limit of {} bytes", length,
                             options_.max_body_bytes));
      return;
    }
    while (buf.size() < length) {
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      buf.append(chunk, size_t(n));
    }
    req.body = buf.substr(0, length);
    buf.erase(0, length);
    handler_(req, res);
    if (!res.sent())
      res.send(500, "application/json",
               R"({"error": {"message": "no response", "type": "InternalServerError", "param": null, "code": 500}})");
    if (!res.keep_alive) return;
  }
}

}  // namespace nibble
