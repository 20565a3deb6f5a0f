#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "server/chat_page.h"
#include "server/connection_watch.h"
#include "server/openai_format.h"
#include "server/plan.h"

namespace dsv3::server {

namespace {

constexpr double kPollSeconds = 0.1;  // how often an idle answer checks that its client is still there
constexpr size_t kMaxThreads = 900;   // connection threads at most

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

ErrorKind kind_of(const ApiError& e) {
  switch (e.status) {
    case 400:
      return e.code == "context_length_exceeded" ? ErrorKind::kContextLength : ErrorKind::kInvalidRequest;
    case 401:
      return ErrorKind::kAuthentication;
    case 404:
      return ErrorKind::kNotFound;
    case 413:
      return ErrorKind::kPayloadTooLarge;
    case 429:
      return ErrorKind::kQueueFull;
    case 503:
      return ErrorKind::kShuttingDown;
    default:
      return e.status >= 500 ? ErrorKind::kEngine : ErrorKind::kInvalidRequest;
  }
}

// Compares without an early exit, so the time taken does not tell how much of a key was right.
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ b[i]);
  return diff == 0;
}

// httplib's server with a longer listen queue: Debian's build listens with a backlog of 5, and
// a burst of clients connecting at once overflows it (their connections wait for a SYN
// retransmit, some fail). listen() again on the bound socket sets the new backlog.
class Listener : public httplib::Server {
 public:
  bool widen_backlog(int n) { return ::listen(svr_sock_, n) == 0; }
};

// Counts an answer in flight for as long as it lives.
struct Active {
  explicit Active(std::atomic<int>& n) : n_(n) { n_++; }
  ~Active() { n_--; }
  Active(const Active&) = delete;
  Active& operator=(const Active&) = delete;
  std::atomic<int>& n_;
};

// A streamed answer: server-sent events written by httplib's chunked content provider, which
// calls step() until the answer ends or the client is gone.
struct StreamState {
  StreamState(std::unique_ptr<Generation> g, ResponseWriter w, bool include_usage, ServerShared& shared,
              std::atomic<int>& active)
      : gen(std::move(g)), writer(std::move(w)), usage(include_usage), shared(shared), active(active) {}
  std::unique_ptr<Generation> gen;
  ResponseWriter writer;
  bool usage;
  ServerShared& shared;
  Active active;
  bool started = false, ended = false;
  Clock::time_point checked = Clock::now();  // when the connection was last checked

  bool event(httplib::DataSink& sink, const std::string& data) {
    const std::string s = "data: " + data + "\n\n";
    return sink.write(s.data(), s.size());
  }
  bool event(httplib::DataSink& sink, const json& j) {
    return event(sink, j.dump(-1, ' ', false, json::error_handler_t::replace));
  }
  // Ends the stream: an error event when the answer failed, the usage chunk, [DONE].
  bool end(httplib::DataSink& sink, const ApiError* error) {
    ended = true;
    if (error) {
      shared.metrics.count_error(kind_of(*error));
      if (!event(sink, error_body(*error))) return false;
    } else if (usage && !event(sink, writer.usage_chunk(gen->usage()))) {
      return false;
    }
    if (!event(sink, std::string("[DONE]"))) return false;
    sink.done();
    return true;
  }
  bool step(httplib::DataSink& sink, Endpoint ep) {
    if (!started) {  // chat: each choice opens with its role, before any token
      started = true;
      if (ep == Endpoint::kChat)
        for (int c = 0; c < gen->choices(); ++c)
          if (!event(sink, writer.role_chunk(c, usage))) return false;
    }
    std::vector<ChoiceUpdate> updates = gen->poll(kPollSeconds);
    for (const ChoiceUpdate& u : updates) {
      if (!u.error.empty()) {
        gen->cancel();
        ApiError e(u.engine_finish == Finish::kCancelled ? 503 : 500, u.error);
        return end(sink, &e);
      }
      for (const json& c : writer.chunks(u, usage))
        if (!event(sink, c)) return false;
    }
    if (gen->done()) return end(sink, nullptr);
    // A client that left is seen when a write fails, or here while nothing is written.
    if (Clock::now() - checked >= std::chrono::duration<double>(kPollSeconds)) {
      checked = Clock::now();
      if (!sink.is_writable()) return false;
    }
    return true;
  }
  void released(bool success) {
    if (success && ended) return;
    gen->cancel();
    shared.metrics.count_error(ErrorKind::kClientDisconnect);
  }
};

}  // namespace

HttpServer::HttpServer(Engine& engine, const Tokenizer& tok, const ChatTemplate* tmpl, ServeOptions opt)
    : engine_(engine), tok_(tok), tmpl_(tmpl), encoder_(tok), opt_(std::move(opt)) {
  if (opt_.max_seqs < 1) fail("--max-seqs must be >= 1, got ", opt_.max_seqs);
  if (opt_.max_queue < 0) opt_.max_queue = 8 * opt_.max_seqs;
  shared_ = std::make_shared<ServerShared>(opt_.max_seqs + opt_.max_queue);
  started_ = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  http_ = std::make_unique<Listener>();
  // One thread per connection: enough for every admitted request plus some to refuse the rest
  // (429) and answer /health and /metrics while the queue is full; at most kMaxThreads (httplib
  // 0.11 waits on sockets with select(), which takes descriptors below 1024 only). Connections
  // beyond that wait for a thread.
  const size_t threads = std::min<size_t>(size_t(shared_->capacity()) + 16, kMaxThreads);
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(opt_.max_body_bytes);
  http_->set_keep_alive_max_count(100);
  // Streamed tokens are small writes: sent at once, not held back until the client acknowledges
  // the previous one (Nagle's algorithm against a delayed ACK adds up to 40 ms per event).
  http_->set_tcp_nodelay(true);
  routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  int port = opt_.port;
  if (port == 0) {
    port = http_->bind_to_any_port(opt_.host);
    if (port < 0) fail("cannot bind ", opt_.host, " to a free port");
  } else if (!http_->bind_to_port(opt_.host, port)) {
    fail("cannot listen on ", opt_.host, ":", port, " (in use, or not an address of this machine?)");
  }
  if (!static_cast<Listener&>(*http_).widen_backlog(SOMAXCONN)) fail("cannot set the listen queue of port ", port);
  return port;
}

void HttpServer::serve() {
  if (!draining_) http_->listen_after_bind();
}

void HttpServer::shutdown() {
  if (draining_.exchange(true)) return;
  engine_.shutdown(opt_.drain_timeout_s);  // every request has had its last event when it returns
  // The answers still open write their ends now; give them a moment, bounded.
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (active_ > 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  http_->stop();
}

void HttpServer::hurry() { engine_.shutdown(0); }

bool HttpServer::authorized(const httplib::Request& req) const {
  if (opt_.api_key.empty()) return true;
  const std::string h = req.get_header_value("Authorization");
  const std::string prefix = "Bearer ";
  return h.compare(0, prefix.size(), prefix) == 0 && same_secret(h.substr(prefix.size()), opt_.api_key);
}

void HttpServer::reply_error(httplib::Response& res, const ApiError& e) {
  shared_->metrics.count_error(kind_of(e));
  send_json(res, e.status, error_body(e));
  if (e.status == 429) res.set_header("Retry-After", "1");
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
}

void HttpServer::routes() {
  http_->set_pre_routing_handler([this](const httplib::Request& req,
                                        httplib::Response& res) -> httplib::Server::HandlerResponse {
    if (req.path.rfind("/v1/", 0) == 0 && !authorized(req)) {
      reply_error(res, ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", "",
                          "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Errors httplib answers itself (no route, a body over the limit, a malformed request line)
  // come with an empty body: give them the OpenAI error object too.
  http_->set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                       httplib::Response& res) {
    if (!res.body.empty() || res.content_length_ > 0) return httplib::Server::HandlerResponse::Unhandled;
    const int status = res.status;
    std::string message = str("HTTP ", status);
    if (status == 404) message = str("no route for ", req.method, " ", req.path);
    if (status == 413) message = str("the request body is larger than the limit of ", opt_.max_body_bytes, " bytes");
    if (status == 400) message = "malformed HTTP request";
    if (status == 414) message = "the request URI is too long";
    reply_error(res, ApiError(status, message));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http_->set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    reply_error(res, ApiError(500, "internal error: " + what));
  });
  http_->Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(req, res, Endpoint::kChat);
  });
  http_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(req, res, Endpoint::kCompletion);
  });
  http_->Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { models(req, res); });
  http_->Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) { models(req, res); });
  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, draining_ ? 503 : 200, {{"status", draining_ ? "draining" : "ok"}});
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) { metrics(res); });
  http_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(chat_page_html(), "text/html; charset=utf-8");
  });
}

void HttpServer::models(const httplib::Request& req, httplib::Response& res) {
  const json card = {{"id", opt_.model_name},
                     {"object", "model"},
                     {"created", started_},
                     {"owned_by", "dsv3"},
                     {"max_model_len", engine_.max_context()}};
  if (req.matches.size() > 1) {
    if (req.matches[1].str() != opt_.model_name)
      return reply_error(res, ApiError(404, str("the model '", req.matches[1].str(), "' does not exist: this server serves '",
                                           opt_.model_name, "'"),
                                  "model", "model_not_found"));
    return send_json(res, 200, card);
  }
  send_json(res, 200, {{"object", "list"}, {"data", json::array({card})}});
}

void HttpServer::metrics(httplib::Response& res) {
  res.set_content(shared_->metrics.render(engine_.stats(), opt_.model_name), "text/plain; version=0.0.4; charset=utf-8");
}

void HttpServer::completions(const httplib::Request& req, httplib::Response& res, Endpoint ep) {
  const Clock::time_point arrival = Clock::now();
  Active active(active_);
  try {
    if (draining_) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    const ApiRequest r = parse_api_request(req.body, ep);
    if (!r.model.empty() && r.model != opt_.model_name)
      throw ApiError(404, str("the model '", r.model, "' does not exist: this server serves '", opt_.model_name, "'"),
                     "model", "model_not_found");
    // Checked before the prompts are planned: that makes n x prompts copies of them.
    const int n = r.n * (ep == Endpoint::kChat ? 1 : int(r.prompts.size()));
    if (n > shared_->capacity())
      throw ApiError(400, str("the request asks for ", n, " sequences (prompts x n), more than the server holds (",
                              shared_->capacity(), ": --max-seqs + --max-queue)"),
                     "n");
    std::vector<ChoiceSpec> specs =
        plan_choices(r, {tok_, encoder_, tmpl_, engine_.max_context(), engine_.vocab_size()});
    if (!shared_->reserve(n))
      throw ApiError(429, str("the server's queue is full (", shared_->capacity(),
                              " sequences running or waiting): retry later"),
                     "", "queue_full");
    std::unique_ptr<Generation> gen;
    try {
      gen = std::make_unique<Generation>(engine_, shared_, tok_, std::move(specs), arrival);
    } catch (const Error& e) {  // the engine refused a request (the reservation is released)
      throw ApiError(draining_ ? 503 : 400, e.what());
    }
    ResponseWriter writer(tok_, new_response_meta(ep, opt_.model_name, r.logprobs >= 0), n);
    if (r.stream) {
      auto st = std::make_shared<StreamState>(std::move(gen), std::move(writer), r.include_usage, *shared_, active_);
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream",
          [st, ep](size_t, httplib::DataSink& sink) {
            try {
              return st->step(sink, ep);
            } catch (const std::exception& e) {  // nothing may escape into httplib's writer
              std::fprintf(stderr, "dsv3 serve: a stream failed: %s\n", e.what());
              return false;
            }
          },
          [st](bool success) { st->released(success); });
      return;
    }
    answer(req, res, *gen, writer);
  } catch (const ApiError& e) {
    reply_error(res, e);
  }
}

void HttpServer::answer(const httplib::Request& req, httplib::Response& res, Generation& gen, ResponseWriter& writer) {
  ConnectionWatch watch(req.remote_addr, req.remote_port, req.local_port);
  Clock::time_point checked = Clock::now();
  while (!gen.done()) {
    for (const ChoiceUpdate& u : gen.poll(kPollSeconds)) {
      if (!u.error.empty()) {
        gen.cancel();
        return reply_error(res, ApiError(u.engine_finish == Finish::kCancelled ? 503 : 500, u.error));
      }
      writer.collect(u);
    }
    if (Clock::now() - checked < std::chrono::duration<double>(kPollSeconds)) continue;
    checked = Clock::now();
    if (watch.closed()) {
      gen.cancel();
      shared_->metrics.count_error(ErrorKind::kClientDisconnect);
      return send_json(res, 499, error_body(ApiError(499, "the client closed the connection")));  // unread
    }
  }
  send_json(res, 200, writer.response(gen.usage()));
}

}  // namespace dsv3::server
