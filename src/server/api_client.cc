#include "server/api_client.h"

#include <httplib.h>

namespace dsv3::server {

ApiClient::ApiClient(const std::string& base_url, const std::string& api_key, double timeout_s)
    : cli_(std::make_unique<httplib::Client>(base_url)), api_key_(api_key) {
  const auto t = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::duration<double>(timeout_s));
  cli_->set_read_timeout(t);
  cli_->set_write_timeout(t);
  cli_->set_connection_timeout(std::chrono::seconds(10));
  cli_->set_keep_alive(true);
  cli_->set_tcp_nodelay(true);  // requests go out whole at once (see the server's)
}

ApiClient::~ApiClient() = default;

ApiClient::Result ApiClient::get(const std::string& path) {
  httplib::Headers h;
  if (!api_key_.empty()) h.emplace("Authorization", "Bearer " + api_key_);
  Result r;
  auto res = cli_->Get(path, h);
  if (!res) {
    r.error = httplib::to_string(res.error());
    return r;
  }
  r.status = res->status;
  r.body = res->body;
  return r;
}

bool parse_sse(std::string& buffer, const std::string& chunk, const ApiClient::EventFn& on_data) {
  for (char c : chunk)
    if (c != '\r') buffer += c;
  size_t end;
  while ((end = buffer.find("\n\n")) != std::string::npos) {
    std::string block = buffer.substr(0, end), data;
    buffer.erase(0, end + 2);
    bool any = false;
    size_t pos = 0;
    while (pos <= block.size()) {
      size_t nl = block.find('\n', pos);
      if (nl == std::string::npos) nl = block.size();
      std::string line = block.substr(pos, nl - pos);
      pos = nl + 1;
      if (line.rfind("data:", 0) != 0) continue;
      std::string value = line.substr(5);
      if (!value.empty() && value[0] == ' ') value.erase(0, 1);
      data += (any ? "\n" : "") + value;
      any = true;
    }
    if (any && !on_data(data)) return false;
  }
  return true;
}

ApiClient::Result ApiClient::post(const std::string& path, const std::string& json_body, const EventFn& on_event) {
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = json_body;
  req.set_header("Content-Type", "application/json");
  if (!api_key_.empty()) req.set_header("Authorization", "Bearer " + api_key_);
  Result r;
  std::string pending;
  bool stopped = false;
  int status = 0;
  req.response_handler = [&](const httplib::Response& head) {
    status = head.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    r.body.append(data, n);
    if (!on_event || status != 200) return true;
    if (!parse_sse(pending, std::string(data, n), on_event)) stopped = true;
    return !stopped;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!cli_->send(req, res, err) && !stopped) {
    r.error = httplib::to_string(err);
    r.status = status;
    return r;
  }
  r.status = stopped ? status : res.status;  // stopped: httplib has closed the connection
  return r;
}

}  // namespace dsv3::server
