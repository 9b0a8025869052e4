// Reading protobuf messages from the YAML or JSON that users write (job
// specs), with errors that name the field path and line.
//
// YAML: the subset configuration files use: block mappings and sequences
// (including "- key: value" items), flow sequences and mappings ([a, b],
// {k: v}), plain, single- and double-quoted scalars, '#' comments and a
// leading '---'. Anchors, aliases, tags and multi-line scalars are refused
// with the line that uses them. JSON is the document when it starts with '{'.
//
// Mapping onto the message: keys are field names in snake_case or
// lowerCamelCase; enum values are their names, case-insensitive, with or
// without the enum's common prefix (`bf16` for DTYPE_BF16); numbers must fit
// the field's type; unknown keys are errors that list the allowed ones.
#ifndef FULCRUM_COMMON_CONFIG_SPEC_TEXT_H_
#define FULCRUM_COMMON_CONFIG_SPEC_TEXT_H_

#include <string>
#include <string_view>
#include <vector>

#include <google/protobuf/message.h>

#include "absl/status/status.h"

namespace fulcrum::config {

// Parses `text` into `out`. On failure, INVALID_ARGUMENT whose message lists
// every problem found, one per line, as "<path>: <what> (line N)".
// `source` names the file in messages.
absl::Status ParseSpecText(std::string_view text, std::string_view source,
                           google::protobuf::Message* out);

// Reads and parses a file.
absl::Status ParseSpecFile(const std::string& path, google::protobuf::Message* out);

}  // namespace fulcrum::config

#endif  // FULCRUM_COMMON_CONFIG_SPEC_TEXT_H_
