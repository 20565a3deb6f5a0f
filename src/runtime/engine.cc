#include "runtime/engine.h"

namespace dsv3 {

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kNone:
      return "";
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    case Finish::kCancelled:
      return "cancelled";
    case Finish::kError:
      return "error";
  }
  return "";
}

}  // namespace dsv3
