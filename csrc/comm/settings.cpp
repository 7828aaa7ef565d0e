#include "settings.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace tp_ext::comm {

namespace {

constexpr const char* kShmAllowed = "1 (on) or 0 (off) (also true/false, on/off, yes/no)";
constexpr const char* kSlotAllowed =
    "a whole number of bytes from 4096 to 1073741824 (1 GiB), a multiple of 64 (default "
    "1048576)";

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? nullptr : v;
}

// 1, 0, or -1 when the text is not a boolean.
int parse_bool(std::string v) {
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "on" || v == "yes") return 1;
  if (v == "0" || v == "false" || v == "off" || v == "no") return 0;
  return -1;
}

void read_bool(const char* name, bool* out, int64_t bit, EnvSettings* s) {
  const char* v = env(name);
  if (v == nullptr) return;
  const int b = parse_bool(v);
  if (b >= 0) {
    *out = b == 1;
    return;
  }
  s->bad |= bit;
  s->error += std::string("tp_ext: ") + name + "='" + v + "' is not valid; use " + kShmAllowed +
              ", or unset it.\n";
}

}  // namespace

EnvSettings read_env() {
  EnvSettings s;
  read_bool("TP_EXT_SHM", &s.shm, 1, &s);
  read_bool("TP_EXT_CHECK_COLLECTIVES", &s.checks, 4, &s);
  if (const char* v = env("TP_EXT_SHM_SLOT_BYTES")) {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    const bool ok = errno == 0 && end != v && *end == '\0' && n >= kMinSlotBytes &&
                    n <= kMaxSlotBytes && n % 64 == 0;
    if (ok) {
      s.slot_bytes = n;
    } else {
      s.bad |= 2;
      s.error += std::string("tp_ext: TP_EXT_SHM_SLOT_BYTES='") + v + "' is not valid; use " +
                 kSlotAllowed + ".\n";
    }
  }
  if (!s.error.empty()) s.error.pop_back();
  return s;
}

std::string describe_bad(int64_t bad) {
  std::ostringstream os;
  if (bad & 1) os << " TP_EXT_SHM (allowed: " << kShmAllowed << ")";
  if (bad & 2) os << " TP_EXT_SHM_SLOT_BYTES (allowed: " << kSlotAllowed << ")";
  if (bad & 4) os << " TP_EXT_CHECK_COLLECTIVES (allowed: " << kShmAllowed << ")";
  return os.str();
}

std::string test_die_stage() {
  const char* v = env("TP_EXT_TEST_DIE_IN_SHM_SETUP");
  return v == nullptr ? "" : v;
}

}  // namespace tp_ext::comm
