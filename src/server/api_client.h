// A small client of the server's API (cpp-httplib), for `dsv3 bench-serve` and the tests: GET,
// and POST of a JSON body answered either whole or as server-sent events passed on one by one
// as they arrive.
#pragma once
#include <functional>
#include <memory>
#include <string>

namespace httplib {
class Client;
}

namespace dsv3::server {

class ApiClient {
 public:
  // base_url: "http://host:port". `api_key` (if any) is sent as a bearer token.
  explicit ApiClient(const std::string& base_url, const std::string& api_key = "", double timeout_s = 600);
  ~ApiClient();
  ApiClient(const ApiClient&) = delete;
  ApiClient& operator=(const ApiClient&) = delete;

  struct Result {
    int status = 0;     // 0: no HTTP answer (see error)
    std::string body;   // the whole body (for an event stream: what was received)
    std::string error;  // a transport failure ("" when the server answered)
  };
  // Called with each event's data (the "data:" lines joined), e.g. a JSON chunk or "[DONE]";
  // returning false stops reading and closes the connection.
  using EventFn = std::function<bool(const std::string& data)>;

  Result get(const std::string& path);
  Result post(const std::string& path, const std::string& json_body, const EventFn& on_event = {});

 private:
  std::unique_ptr<httplib::Client> cli_;
  std::string api_key_;
};

// Splits event-stream text into events: appends `chunk` to `buffer` and calls on_data for each
// complete event's data (lines after "data:", joined by newlines; comments and other fields
// skipped). Returns false when on_data did.
bool parse_sse(std::string& buffer, const std::string& chunk, const ApiClient::EventFn& on_data);

}  // namespace dsv3::server
