// --help for binaries whose flags live in a file not named after the program.
#ifndef ATTENTION_COMMON_FLAGS_HELP_H_
#define ATTENTION_COMMON_FLAGS_HELP_H_

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace attention {

// Sets the program's usage message, and has --help and --helpshort list the
// flags defined in the source files whose path ends with `flags_file` (Abseil
// lists only those of a file named after the program by default, and prints
// "No flags matched." for every binary here). --helpfull still lists all.
inline void SetUsageAndHelpFile(absl::string_view usage, absl::string_view flags_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [file = std::string(flags_file)](absl::string_view path) {
    return absl::EndsWith(path, file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace attention

#endif  // ATTENTION_COMMON_FLAGS_HELP_H_
