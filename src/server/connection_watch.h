// Whether the client of a request still waits for its answer. cpp-httplib 0.11 gives a handler
// neither the socket nor a way to ask, so the watch finds the connection's socket among this
// process's descriptors by its two ends (a TCP connection's four-tuple is unique while it is
// open, and httplib keeps it open until the handler returns), then polls it for the peer's close.
#pragma once
#include <string>

namespace dsv3::server {

class ConnectionWatch {
 public:
  // The connection from remote_addr:remote_port to our local_port (as httplib's Request has them).
  ConnectionWatch(const std::string& remote_addr, int remote_port, int local_port);
  bool found() const { return fd_ >= 0; }
  // True once the peer has closed its end or the connection failed; false while it is open (and
  // always when the socket was not found).
  bool closed() const;

 private:
  int fd_ = -1;
};

}  // namespace dsv3::server
