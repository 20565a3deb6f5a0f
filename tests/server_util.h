// Helpers of the server tests: `dsv3 serve` as a child process on a free port (on the tiny
// model of tiny_model.h), JSON and event-stream requests through the server's ApiClient, and
// raw bytes over a socket.
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "server/api_client.h"
#include "tiny_model.h"

extern char** environ;

namespace server_test {

using json = nlohmann::json;

// `dsv3 serve --model <model> --port 0 <args>` as a child process; its output is collected.
class ServerProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& args, const std::string& model = tiny_model()) {
    std::vector<std::string> argv = {DSV3_BINARY, "serve", "--model", model, "--port", "0"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    const int rc = posix_spawn(&pid_, DSV3_BINARY, &fa, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    if (rc != 0) throw std::runtime_error("cannot start " + std::string(DSV3_BINARY));
    out_ = fds[0];
    reader_ = std::thread([this] {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(out_, buf, sizeof buf)) > 0) {
        std::lock_guard<std::mutex> lk(mu_);
        log_.append(buf, size_t(n));
      }
    });
    const std::string key = "listening on http://127.0.0.1:";
    for (int i = 0; i < 1200 && port_ == 0; ++i) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        const size_t at = log_.find(key);
        if (at != std::string::npos && log_.find('\n', at) != std::string::npos)
          port_ = std::atoi(log_.c_str() + at + key.size());
      }
      if (port_ == 0) {
        if (exited()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    if (port_ == 0) {
      kill_now();
      throw std::runtime_error("dsv3 serve did not start:\n" + log());
    }
  }
  ~ServerProcess() { kill_now(); }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::string log() const {
    std::lock_guard<std::mutex> lk(mu_);
    return log_;
  }
  // Sends `sig`, then waits up to timeout_s: the exit code, 128 + the signal that killed it, or
  // -1 when it is still running.
  int stop(int sig, double timeout_s) {
    ::kill(pid_, sig);
    return wait(timeout_s);
  }
  int wait(double timeout_s) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < until) {
      if (exited()) return status_;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  bool exited() {
    if (done_) return true;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return false;
    done_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return true;
  }
  void kill_now() {
    if (pid_ > 0 && !exited()) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      done_ = true;
    }
    if (reader_.joinable()) reader_.join();
    if (out_ >= 0) ::close(out_), out_ = -1;
  }
  pid_t pid_ = -1;
  int port_ = 0, out_ = -1, status_ = -1;
  bool done_ = false;
  std::thread reader_;
  mutable std::mutex mu_;
  std::string log_;
};

struct Reply {
  int status = 0;
  json body;  // null when the body is not JSON
  std::string raw;
};

inline Reply get(const std::string& url, const std::string& path, const std::string& key = "") {
  dsv3::server::ApiClient cli(url, key, 120);
  auto r = cli.get(path);
  return {r.status, json::parse(r.body, nullptr, false, true), r.body};
}

inline Reply post(const std::string& url, const std::string& path, const json& body, const std::string& key = "") {
  dsv3::server::ApiClient cli(url, key, 120);
  auto r = cli.post(path, body.dump());
  json j = json::parse(r.body, nullptr, false);
  return {r.status, j.is_discarded() ? json() : j, r.body};
}

struct Stream {
  int status = 0;
  std::vector<json> events;  // the JSON events, in order
  bool done = false;         // [DONE] came last
  std::string raw;
};

// POSTs with "stream": true and collects the events; `stop_after` > 0 closes the connection
// after that many events.
inline Stream stream(const std::string& url, const std::string& path, json body, int stop_after = 0) {
  body["stream"] = true;
  dsv3::server::ApiClient cli(url, "", 120);
  Stream s;
  auto r = cli.post(path, body.dump(), [&](const std::string& data) {
    if (data == "[DONE]") {
      s.done = true;
      return true;
    }
    s.done = false;
    s.events.push_back(json::parse(data, nullptr, false));
    return stop_after <= 0 || int(s.events.size()) < stop_after;
  });
  s.status = r.status;
  s.raw = r.body;
  return s;
}

// Opens a connection to the server and sends `bytes` as they are; returns the socket (-1 when
// the connection fails). The caller closes it.
inline int send_raw(int port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += size_t(n);
  }
  return fd;
}

// A POST of a JSON body as raw HTTP/1.1 bytes.
inline std::string http_post(const std::string& path, const json& body) {
  const std::string b = body.dump();
  return "POST " + path + " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(b.size()) + "\r\n\r\n" + b;
}

// Sends `bytes` as they are over a new connection and returns all the server sends back until
// it closes the connection (or timeout_s passes).
inline std::string raw_http(int port, const std::string& bytes, double timeout_s = 30) {
  const int fd = send_raw(port, bytes);
  if (fd < 0) return "";
  std::string out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 100};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  ::close(fd);
  return out;
}

// The value of a metric line "name{labels} value" in a /metrics text (labels: exact text in the
// braces, "" for none); -1 when absent.
inline double metric(const std::string& text, const std::string& name, const std::string& labels = "") {
  size_t pos = 0;
  const std::string head = name + (labels.empty() ? "" : "{" + labels + "}");
  while ((pos = text.find(head, pos)) != std::string::npos) {
    const bool line_start = pos == 0 || text[pos - 1] == '\n';
    const char after = text[pos + head.size()];
    if (line_start && (after == ' ' || (labels.empty() && after == '{'))) {
      const size_t sp = text.find(' ', pos + head.size());
      return std::atof(text.c_str() + sp + 1);
    }
    pos += head.size();
  }
  return -1;
}

}  // namespace server_test
