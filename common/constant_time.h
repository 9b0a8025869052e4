// Comparison of secrets (tokens, password hashes) whose running time does
// not depend on where the inputs first differ.
#ifndef FULCRUM_COMMON_CONSTANT_TIME_H_
#define FULCRUM_COMMON_CONSTANT_TIME_H_

#include "absl/strings/string_view.h"

namespace fulcrum {

// True when equal; the time depends only on the lengths, so it does not
// tell an attacker how much of a guess was right.
inline bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_CONSTANT_TIME_H_
