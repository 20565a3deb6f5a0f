// A read-only memory mapping of a whole file; weights are used in place from it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dsv3 {

class MmapFile {
 public:
  explicit MmapFile(const std::string& path);  // throws Error naming the path
  ~MmapFile();
  MmapFile(const MmapFile&) = delete;
  MmapFile& operator=(const MmapFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Drops the pages from this process's mapping (they stay in the page cache, evictable; a later
  // read maps them again): once the data lives elsewhere.
  void release();

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Drops the pages under [p, p + n) from this process's mapping where the range lies inside a live
// MmapFile (true); anywhere else (heap or anonymous memory, whose pages would be lost) does nothing
// (false).
bool release_mapped_pages(const void* p, size_t n);

// Reads a whole (small) file into a string; throws Error naming the path.
std::string read_text_file(const std::string& path);
bool file_exists(const std::string& path);

// Writes `bytes` to path atomically: a temporary file in the same folder, fsync, then rename.
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace dsv3
