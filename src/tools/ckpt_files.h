// Files of the commands that write a checkpoint from another one (convert, cast-bf16): the
// output directory written whole or not at all, listing and copying input files, and letting go
// of input pages once they are read.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv3 {

// Everything goes into `out`.partial-<pid>/ beside `out`, which is renamed to `out` at the end.
// An interrupted or failed run never leaves a directory named `out` (a killed run's partial
// directory is removed by the next run into the same `out`).
class StagedDir {
 public:
  // Refuses (Error naming the path) unless `out` is missing or an empty directory. Creates
  // nothing yet. `flag` names the option that gave `out`, for messages ("--save-path").
  StagedDir(const std::string& out, const std::string& flag);
  // Removes the partial directory and any parent folders it created, unless commit() succeeded.
  ~StagedDir();
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  // Creates the missing parents and the partial directory; refuses when the file system there
  // has less than `bytes` free. Returns the partial directory.
  const std::string& begin(uint64_t bytes);
  const std::string& partial() const { return partial_; }
  const std::string& out() const { return out_; }
  // fsyncs the partial directory and renames it to `out`.
  void commit();

 private:
  std::string out_, partial_;
  std::string created_parent_;  // the outermost parent folder begin() created, if any
  bool begun_ = false, committed_ = false;
};

// The regular files directly in `dir` whose names end in `suffix`, sorted; Error naming `dir`
// when it is missing or not a directory.
std::vector<std::string> list_files(const std::string& dir, const std::string& suffix = "");

// Copies `from` to `to` in pieces (no size limit) through a temporary name, then renames it.
void copy_file_atomic(const std::string& from, const std::string& to);

// Drops the pages of [p, p + n) of a read-only file mapping from this process (the page cache
// keeps them), so streaming through a mapped shard does not grow the resident set to its size.
void release_pages(const void* p, size_t n);

}  // namespace dsv3
