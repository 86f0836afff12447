#include "tests/safetensors_writer.h"

#include <stdlib.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace attention::testing {

std::string SafetensorsBytes(const StateDict& dict) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [key, tensor] : dict) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(tensor.data.data()),
                tensor.data.size() * sizeof(float));
    header[key] = {{"dtype", "F32"}, {"shape", tensor.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + text + data;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

namespace {

// The folders MakeTempDir made in this process, removed when it exits.
class TempDirs {
 public:
  static TempDirs& Get() {
    static TempDirs* dirs = [] {
      auto* d = new TempDirs();
      std::atexit([] { Get().RemoveAll(); });
      return d;
    }();
    return *dirs;
  }

  void Add(std::string dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(std::move(dir));
  }

 private:
  void RemoveAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& dir : dirs_) {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
    dirs_.clear();
  }

  std::mutex mu_;
  std::vector<std::string> dirs_;
};

}  // namespace

std::string MakeTempDir(const std::string& name) {
  // Unique per call: ctest runs each test in its own process, several at once.
  std::string pattern = (std::filesystem::path(::testing::TempDir()) / (name + ".XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << pattern << " failed";
  } else {
    TempDirs::Get().Add(pattern);
  }
  return pattern;
}

}  // namespace attention::testing
