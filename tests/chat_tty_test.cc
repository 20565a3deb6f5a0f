// dsv3 chat driven through a real terminal (tmux): type, see the answer stream, /clear, Ctrl-C
// stops an answer (not the program), /exit quits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "text/tokenizer.h"
#include "tools/synth.h"

namespace {

std::string sh(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

class ChatTty : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(std::system("command -v tmux >/dev/null"), 0) << "tmux is required (scripts/setup.sh installs it)";
    dir_ = ::testing::TempDir() + "/dsv3_chat_" + std::to_string(::getpid());
    std::system(("rm -rf '" + dir_ + "'").c_str());
    dsv3::SynthOptions o;
    o.shape = "tiny";
    o.dtype = "fp8";
    o.out_dir = dir_ + "/model";
    o.seed = 3;
    o.fsync = false;
    o.tokenizer_dir = dsv3::find_tokenizer_dir("");
    dsv3::synthesize(o);
    session_ = "dsv3chat" + std::to_string(::getpid());
  }
  void TearDown() override {
    std::system(("tmux kill-session -t " + session_ + " 2>/dev/null").c_str());
    std::system(("rm -rf '" + dir_ + "'").c_str());
  }
  std::string screen() { return sh("tmux capture-pane -p -J -S -200 -t " + session_ + " 2>/dev/null"); }
  bool alive() { return std::system(("tmux has-session -t " + session_ + " 2>/dev/null").c_str()) == 0; }
  void keys(const std::string& k) { std::system(("tmux send-keys -t " + session_ + " " + k).c_str()); }
  int count(const std::string& needle) {
    std::string s = screen();
    int n = 0;
    for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
    return n;
  }
  // Waits until the screen contains `needle` at least `count` times.
  bool wait_for(const std::string& needle, int count = 1, double seconds = 60) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(int(seconds * 1000));
    while (std::chrono::steady_clock::now() < until) {
      if (this->count(needle) >= count) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  // Waits until chat shows its input prompt ("> " as the screen's last line that is not blank):
  // keys typed before it would be echoed by the terminal ahead of the prompt.
  bool wait_prompt(double seconds = 30) {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(int(seconds * 1000));
    while (std::chrono::steady_clock::now() < until) {
      const std::string s = screen();
      const size_t end = s.find_last_not_of(" \n\r\t");
      if (end != std::string::npos) {
        const size_t nl = s.rfind('\n', end), start = nl == std::string::npos ? 0 : nl + 1;
        if (s.compare(start, end + 1 - start, ">") == 0) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  std::string dir_, session_;
};

TEST_F(ChatTty, TypeStreamClearInterruptExit) {
  std::string cmd = std::string(DSV3_BINARY) + " chat --model " + dir_ + "/model --backend ref --temperature 0.8 " +
                    "--max-new-tokens 3000 --max-len 8192; echo CHAT-EXITED-$?; sleep 30";
  ASSERT_EQ(std::system(("tmux new-session -d -s " + session_ + " -x 160 -y 50 '" + cmd + "'").c_str()), 0);
  ASSERT_TRUE(wait_for("/exit quits")) << screen();
  ASSERT_TRUE(wait_for("> ")) << screen();

  // Each question gets a long answer; once its text is streaming in (visible before the answer is
  // done), Ctrl-C stops it and the prompt returns with the speed line.
  auto ask_and_interrupt = [&](const std::string& text, int turn) {
    ASSERT_TRUE(wait_prompt()) << "no input prompt before '" << text << "':\n" << screen();
    keys("'" + text + "' Enter");
    bool streaming = false;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!streaming && std::chrono::steady_clock::now() < until) {
      std::string sc = screen();
      size_t q = sc.rfind("> " + text);
      if (q != std::string::npos) {
        int visible = 0;
        for (size_t i = sc.find('\n', q); i != std::string::npos && i < sc.size(); ++i)
          visible += !std::isspace(static_cast<unsigned char>(sc[i]));
        streaming = visible >= 3;
      }
      if (!streaming) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(streaming) << "no streamed answer to '" << text << "':\n" << screen();
    ASSERT_EQ(count("[prompt"), turn - 1) << "the answer finished before it could be interrupted:\n" << screen();
    keys("C-c");
    ASSERT_TRUE(wait_for("[prompt", turn, 30)) << screen();
    EXPECT_TRUE(alive());
  };
  ask_and_interrupt("Hello there", 1);
  ask_and_interrupt("And again", 2);  // the history makes this prompt longer
  ASSERT_TRUE(wait_prompt()) << screen();
  keys("/clear Enter");
  ASSERT_TRUE(wait_for("(history cleared)", 1, 30)) << screen();
  ask_and_interrupt("Fresh start", 3);
  std::string s = screen();
  // Prompt sizes: turn 1 < turn 2 (history), turn 3 (after /clear) back to a short prompt.
  std::vector<int> sizes;
  for (size_t p = s.find("[prompt "); p != std::string::npos; p = s.find("[prompt ", p + 1))
    sizes.push_back(std::atoi(s.c_str() + p + 8));
  ASSERT_EQ(sizes.size(), 3u) << s;
  EXPECT_LT(sizes[0], sizes[1]) << s;
  EXPECT_LT(sizes[2], sizes[1]) << s;

  ASSERT_TRUE(wait_prompt()) << screen();
  keys("/exit Enter");
  ASSERT_TRUE(wait_for("CHAT-EXITED-0", 1, 30)) << screen();
}

}  // namespace
