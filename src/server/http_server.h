// The OpenAI-compatible HTTP server on an Engine (cpp-httplib): POST /v1/chat/completions and
// /v1/completions (streamed as server-sent events or not), GET /v1/models, /health, /metrics and
// the chat page at /. Every refusal is an OpenAI error object; a bad request never harms the
// others. Requests wait in the engine's queue up to a bound (--max-queue), past which they get
// 429. shutdown() drains: new requests get 503, those in flight finish within a bound.
#pragma once
#include <atomic>
#include <memory>
#include <string>

#include "runtime/engine.h"
#include "server/api_request.h"
#include "server/encoder.h"
#include "server/generation.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace dsv3::server {

class ResponseWriter;

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;               // 0: a free port, chosen when bound
  std::string api_key;           // when set, /v1/ requests need "Authorization: Bearer <key>"
  std::string model_name;        // the id clients ask for in "model"
  int max_seqs = 8;              // sequences the engine runs at once
  int max_queue = -1;            // engine requests allowed to wait beyond max_seqs; -1: 8 x max_seqs
  size_t max_body_bytes = 16u << 20;  // larger request bodies get 413
  double drain_timeout_s = 30;   // shutdown: how long requests in flight may still run
};

class HttpServer {
 public:
  // `tmpl` may be null: /v1/chat/completions then answers 400 (the tokenizer has no template).
  HttpServer(Engine& engine, const Tokenizer& tok, const ChatTemplate* tmpl, ServeOptions opt);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int bind();    // binds host:port; returns the port. Throws Error when it cannot.
  void serve();  // answers requests until shutdown() stops it
  // Drains and stops (thread-safe, once): new requests get 503, the engine finishes what it has
  // for up to drain_timeout_s and cancels the rest, then the listener stops and serve() returns.
  void shutdown();
  void hurry();  // during shutdown(): cancel what still runs now

  const ServeOptions& options() const { return opt_; }
  ServerShared& shared() { return *shared_; }

 private:
  void routes();
  void completions(const httplib::Request& req, httplib::Response& res, Endpoint ep);
  // Not streamed: waits for every choice (cancelling them if the client leaves), then answers.
  void answer(const httplib::Request& req, httplib::Response& res, Generation& gen, ResponseWriter& writer);
  void reply_error(httplib::Response& res, const ApiError& e);  // counted in the metrics by kind
  void models(const httplib::Request& req, httplib::Response& res);
  void metrics(httplib::Response& res);
  bool authorized(const httplib::Request& req) const;

  Engine& engine_;
  const Tokenizer& tok_;
  const ChatTemplate* tmpl_;
  Encoder encoder_;
  ServeOptions opt_;
  std::shared_ptr<ServerShared> shared_;
  std::unique_ptr<httplib::Server> http_;
  int64_t started_ = 0;  // Unix seconds
  std::atomic<bool> draining_{false};
  std::atomic<int> active_{0};  // API requests being answered
};

}  // namespace dsv3::server
