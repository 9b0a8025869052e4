#include "common/config/spec_text.h"

#include <cctype>
#include <cmath>
#include <type_traits>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <utility>

#include <google/protobuf/descriptor.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fulcrum::config {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// A parsed YAML/JSON value.
struct Node {
  enum class Kind { kNull, kScalar, kList, kMap };
  Kind kind = Kind::kNull;
  std::string scalar;
  bool quoted = false;
  std::vector<Node> list;
  struct Entry;
  std::vector<Entry> map;  // in document order
  int line = 0;
};
struct Node::Entry {
  std::string first;
  Node second;
};

std::string_view TrimLeft(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  return s;
}
std::string_view TrimRight(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}
std::string_view Trim(std::string_view s) { return TrimRight(TrimLeft(s)); }

const char* KindName(Node::Kind k) {
  switch (k) {
    case Node::Kind::kNull: return "nothing";
    case Node::Kind::kScalar: return "a scalar";
    case Node::Kind::kList: return "a list";
    case Node::Kind::kMap: return "a mapping";
  }
  return "?";
}

struct ParseError {
  std::string message;
  int line = 0;
};

// Lists and mappings nest at most this deep (a job spec needs 4): the
// parsers recurse once per level, and a file of 30 000 '[' must get an
// error, not exhaust the stack.
constexpr int kMaxNesting = 64;

std::string TooDeep() {
  return absl::StrCat("lists and mappings nest more than ", kMaxNesting, " levels deep here");
}

// ---------------------------------------------------------------- flow / JSON

class FlowParser {
 public:
  // `depth`: the levels of nesting around the text (a flow value inside block YAML).
  FlowParser(std::string_view text, int first_line, int depth = 0) : s_(text), line_(first_line), depth_(depth) {}

  bool Parse(Node* out, ParseError* err) {
    if (!Value(out, err)) return false;
    Skip();
    if (i_ != s_.size()) return Fail(err, absl::StrCat("unexpected '", std::string(1, s_[i_]), "' after the value"));
    return true;
  }

 private:
  void Skip() {
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == '\n') {
        ++line_;
        ++i_;
      } else if (c == ' ' || c == '\t' || c == '\r') {
        ++i_;
      } else if (c == '#' && (i_ == 0 || s_[i_ - 1] == ' ' || s_[i_ - 1] == '\n')) {
        while (i_ < s_.size() && s_[i_] != '\n') ++i_;
      } else {
        break;
      }
    }
  }
  bool Fail(ParseError* err, std::string msg) {
    err->message = std::move(msg);
    err->line = line_;
    return false;
  }
  bool Quoted(Node* out, ParseError* err) {
    const char q = s_[i_++];
    std::string v;
    while (i_ < s_.size() && s_[i_] != q) {
      char c = s_[i_++];
      if (c == '\n') return Fail(err, "a quoted string must end on its line");
      if (q == '"' && c == '\\' && i_ < s_.size()) {
        const char e = s_[i_++];
        switch (e) {
          case 'n': c = '\n'; break;
          case 't': c = '\t'; break;
          case '"': case '\\': case '/': c = e; break;
          default: return Fail(err, absl::StrCat("unsupported escape '\\", std::string(1, e), "'"));
        }
      } else if (q == '\'' && c == '\'' && i_ < s_.size() && s_[i_] == '\'') {
        ++i_;  // '' inside single quotes
      }
      v.push_back(c);
    }
    if (i_ >= s_.size()) return Fail(err, "unterminated quoted string");
    ++i_;
    out->kind = Node::Kind::kScalar;
    out->scalar = std::move(v);
    out->quoted = true;
    return true;
  }
  bool Plain(Node* out, ParseError* err) {
    const size_t start = i_;
    while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != ']' && s_[i_] != '}' && s_[i_] != '\n' &&
           !(s_[i_] == ':' && (i_ + 1 == s_.size() || s_[i_ + 1] == ' ')) &&
           !(s_[i_] == '#' && i_ > start && s_[i_ - 1] == ' ')) {
      ++i_;
    }
    std::string v(Trim(s_.substr(start, i_ - start)));
    if (v.empty()) return Fail(err, "expected a value");
    out->kind = Node::Kind::kScalar;
    out->scalar = std::move(v);
    if (out->scalar == "null" || out->scalar == "~") out->kind = Node::Kind::kNull;
    return true;
  }
  bool Value(Node* out, ParseError* err) {
    Skip();
    out->line = line_;
    if (i_ >= s_.size()) return Fail(err, "expected a value");
    const char c = s_[i_];
    if (c == '"' || c == '\'') return Quoted(out, err);
    if ((c == '[' || c == '{') && depth_ >= kMaxNesting) return Fail(err, TooDeep());
    // One level deeper for the list or mapping below.
    struct Level {
      int* depth;
      explicit Level(int* d) : depth(d) { ++*depth; }
      ~Level() { --*depth; }
    };
    if (c == '[') {
      Level level(&depth_);
      ++i_;
      out->kind = Node::Kind::kList;
      Skip();
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return true;
      }
      for (;;) {
        Node item;
        if (!Value(&item, err)) return false;
        out->list.push_back(std::move(item));
        Skip();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') {
          ++i_;
          return true;
        }
        return Fail(err, "expected ',' or ']' in a list");
      }
    }
    if (c == '{') {
      Level level(&depth_);
      ++i_;
      out->kind = Node::Kind::kMap;
      Skip();
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return true;
      }
      for (;;) {
        Node key;
        Skip();
        const int key_line = line_;
        if (i_ < s_.size() && (s_[i_] == '"' || s_[i_] == '\'')) {
          if (!Quoted(&key, err)) return false;
        } else if (!Plain(&key, err)) {
          return false;
        }
        Skip();
        if (i_ >= s_.size() || s_[i_] != ':') return Fail(err, absl::StrCat("expected ':' after key '", key.scalar, "'"));
        ++i_;
        Node value;
        if (!Value(&value, err)) return false;
        value.line = key_line;
        out->map.push_back({key.scalar, std::move(value)});
        Skip();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') {
          ++i_;
          return true;
        }
        return Fail(err, "expected ',' or '}' in a mapping");
      }
    }
    return Plain(out, err);
  }

  std::string_view s_;
  size_t i_ = 0;
  int line_;
  int depth_;
};

// ---------------------------------------------------------------- block YAML

struct Line {
  int indent;
  std::string text;  // without indentation and trailing comment
  int number;
};

// Strips a trailing " # comment" outside quotes.
std::string StripComment(std::string_view s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      if (i == 0 || s[i - 1] == ' ' || s[i - 1] == '[' || s[i - 1] == '{' || s[i - 1] == ',' || s[i - 1] == ':') quote = c;
    } else if (c == '#' && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '\t')) {
      return std::string(TrimRight(s.substr(0, i)));
    }
  }
  return std::string(TrimRight(s));
}

// Position of the ':' that ends a mapping key, or npos.
size_t KeyColon(std::string_view s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
      continue;
    }
    if ((c == '"' || c == '\'') && i == 0) {
      quote = c;
    } else if (c == '[' || c == '{') {
      return std::string_view::npos;  // a flow value, not a key
    } else if (c == ':' && (i + 1 == s.size() || s[i + 1] == ' ')) {
      return i;
    }
  }
  return std::string_view::npos;
}

class BlockParser {
 public:
  explicit BlockParser(std::vector<Line> lines) : lines_(std::move(lines)) {}

  bool Parse(Node* out, ParseError* err) {
    if (lines_.empty()) {
      out->kind = Node::Kind::kMap;
      return true;
    }
    if (!Block(lines_[0].indent, 0, out, err)) return false;
    if (pos_ < lines_.size()) {
      err->message = "unexpected indentation";
      err->line = lines_[pos_].number;
      return false;
    }
    return true;
  }

 private:
  static bool IsItem(const std::string& t) { return t == "-" || t.rfind("- ", 0) == 0; }

  bool Scalar(std::string_view text, int line, int depth, Node* out, ParseError* err) {
    if (!text.empty() && (text[0] == '&' || text[0] == '*' || text[0] == '!' || text[0] == '|' || text[0] == '>')) {
      err->message = absl::StrCat("'", std::string(1, text[0]),
                                  "' (anchors, aliases, tags, block scalars) is not supported in Fulcrum specs");
      err->line = line;
      return false;
    }
    FlowParser p(text, line, depth);
    if (!p.Parse(out, err)) return false;
    out->line = line;
    return true;
  }

  // `depth`: the levels of lists and mappings around this block.
  bool Block(int indent, int depth, Node* out, ParseError* err) {
    out->line = lines_[pos_].number;
    if (depth >= kMaxNesting) {
      err->message = TooDeep();
      err->line = lines_[pos_].number;
      return false;
    }
    if (IsItem(lines_[pos_].text)) {
      out->kind = Node::Kind::kList;
      while (pos_ < lines_.size() && lines_[pos_].indent == indent && IsItem(lines_[pos_].text)) {
        Line& l = lines_[pos_];
        std::string rest = l.text == "-" ? "" : std::string(TrimLeft(l.text.substr(2)));
        Node item;
        item.line = l.number;
        if (rest.empty()) {
          ++pos_;
          if (pos_ < lines_.size() && lines_[pos_].indent > indent) {
            if (!Block(lines_[pos_].indent, depth + 1, &item, err)) return false;
          }
        } else if (KeyColon(rest) != std::string::npos || IsItem(rest)) {
          // "- key: value": a mapping (or nested list) whose first line starts
          // after the dash.
          l.indent = indent + static_cast<int>(l.text.size() - rest.size());
          l.text = rest;
          if (!Block(l.indent, depth + 1, &item, err)) return false;
        } else {
          if (!Scalar(rest, l.number, depth + 1, &item, err)) return false;
          ++pos_;
        }
        out->list.push_back(std::move(item));
      }
      return true;
    }
    out->kind = Node::Kind::kMap;
    while (pos_ < lines_.size() && lines_[pos_].indent == indent) {
      const Line& l = lines_[pos_];
      if (IsItem(l.text)) {
        err->message = "a list item where a mapping key was expected";
        err->line = l.number;
        return false;
      }
      const size_t colon = KeyColon(l.text);
      if (colon == std::string::npos) {
        err->message = absl::StrCat("expected 'key: value', got '", l.text, "'");
        err->line = l.number;
        return false;
      }
      std::string key(Trim(l.text.substr(0, colon)));
      if (key.size() >= 2 && (key[0] == '"' || key[0] == '\'') && key.back() == key[0]) {
        key = key.substr(1, key.size() - 2);
      }
      for (const auto& [k, v] : out->map) {
        if (k == key) {
          err->message = absl::StrCat("key '", key, "' appears twice");
          err->line = l.number;
          return false;
        }
      }
      const std::string rest(Trim(l.text.substr(colon + 1)));
      Node value;
      value.line = l.number;
      ++pos_;
      if (!rest.empty()) {
        if (!Scalar(rest, l.number, depth + 1, &value, err)) return false;
      } else if (pos_ < lines_.size() &&
                 (lines_[pos_].indent > indent || (lines_[pos_].indent == indent && IsItem(lines_[pos_].text)))) {
        if (!Block(lines_[pos_].indent, depth + 1, &value, err)) return false;
        value.line = l.number;
      }
      out->map.push_back({std::move(key), std::move(value)});
    }
    if (pos_ < lines_.size() && lines_[pos_].indent > indent) {
      err->message = "unexpected indentation";
      err->line = lines_[pos_].number;
      return false;
    }
    return true;
  }

  std::vector<Line> lines_;
  size_t pos_ = 0;
};

bool ParseDocument(std::string_view text, Node* out, ParseError* err) {
  size_t first = 0;
  while (first < text.size() && std::isspace(static_cast<unsigned char>(text[first]))) ++first;
  if (first < text.size() && text[first] == '{') {
    FlowParser p(text, 1);
    return p.Parse(out, err);
  }
  std::vector<Line> lines;
  int number = 0;
  std::istringstream in{std::string(text)};
  std::string raw;
  while (std::getline(in, raw)) {
    ++number;
    if (!raw.empty() && raw.back() == '\r') raw.pop_back();
    size_t indent = 0;
    while (indent < raw.size() && raw[indent] == ' ') ++indent;
    if (indent < raw.size() && raw[indent] == '\t') {
      err->message = "tabs cannot indent YAML; use spaces";
      err->line = number;
      return false;
    }
    std::string t = StripComment(std::string_view(raw).substr(indent));
    if (t.empty()) continue;
    if (t == "---" && lines.empty()) continue;
    if (t == "---" || t == "...") {
      err->message = "one document per spec file";
      err->line = number;
      return false;
    }
    lines.push_back({static_cast<int>(indent), std::move(t), number});
  }
  BlockParser p(std::move(lines));
  return p.Parse(out, err);
}

// ---------------------------------------------------------------- to proto

class Binder {
 public:
  explicit Binder(std::vector<std::string>* errors) : errors_(errors) {}

  void BindMessage(const Node& node, const std::string& path, Message* msg) {
    if (node.kind == Node::Kind::kNull) return;
    if (node.kind != Node::Kind::kMap) {
      Error(path, node.line, absl::StrCat("expected a mapping of ", msg->GetDescriptor()->name(), " fields, got ",
                                          KindName(node.kind)));
      return;
    }
    const Descriptor* d = msg->GetDescriptor();
    for (const auto& [key, value] : node.map) {
      const std::string fpath = path.empty() ? key : absl::StrCat(path, ".", key);
      const FieldDescriptor* f = d->FindFieldByName(key);
      if (f == nullptr) f = d->FindFieldByCamelcaseName(key);
      if (f == nullptr) {
        std::vector<std::string> names;
        for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
        Error(fpath, value.line, absl::StrCat("unknown field; ", d->name(), " has: ", absl::StrJoin(names, ", ")));
        continue;
      }
      BindField(value, fpath, f, msg);
    }
  }

 private:
  void Error(const std::string& path, int line, const std::string& what) {
    errors_->push_back(absl::StrCat(path.empty() ? "(document)" : path, ": ", what, " (line ", line, ")"));
  }

  void BindField(const Node& v, const std::string& path, const FieldDescriptor* f, Message* msg) {
    const Reflection* r = msg->GetReflection();
    if (v.kind == Node::Kind::kNull) return;  // "key:" with nothing: the default
    if (f->is_repeated()) {
      if (v.kind != Node::Kind::kList) {
        Error(path, v.line, absl::StrCat("expected a list, got ", KindName(v.kind)));
        return;
      }
      r->ClearField(msg, f);
      for (size_t i = 0; i < v.list.size(); ++i) {
        SetOne(v.list[i], absl::StrCat(path, "[", i, "]"), f, msg, /*add=*/true);
      }
      return;
    }
    // "batch_size: auto": a number field with a sibling message
    // <name>_auto that has `enabled` (JobSpec.batch_size_auto).
    if (v.kind == Node::Kind::kScalar && absl::AsciiStrToLower(v.scalar) == "auto") {
      const FieldDescriptor* a = msg->GetDescriptor()->FindFieldByName(f->name() + "_auto");
      const FieldDescriptor* enabled =
          a != nullptr && a->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE ? a->message_type()->FindFieldByName("enabled")
                                                                           : nullptr;
      if (enabled != nullptr && enabled->cpp_type() == FieldDescriptor::CPPTYPE_BOOL) {
        Message* sub = r->MutableMessage(msg, a);
        sub->GetReflection()->SetBool(sub, enabled, true);
        r->ClearField(msg, f);
        return;
      }
    }
    SetOne(v, path, f, msg, /*add=*/false);
  }

  template <typename T>
  bool Integer(const Node& v, const std::string& path, T* out) {
    if (v.kind != Node::Kind::kScalar) {
      Error(path, v.line, absl::StrCat("expected a whole number, got ", KindName(v.kind)));
      return false;
    }
    const std::string& s = v.scalar;
    errno = 0;
    char* end = nullptr;
    bool ok = !s.empty();
    if constexpr (std::is_unsigned_v<T>) {
      if (ok) {
        ok = s[0] != '-';
        const unsigned long long x = std::strtoull(s.c_str(), &end, 10);
        ok = ok && errno == 0 && *end == 0 && x <= std::numeric_limits<T>::max();
        if (ok) *out = static_cast<T>(x);
      }
    } else {
      if (ok) {
        const long long x = std::strtoll(s.c_str(), &end, 10);
        ok = errno == 0 && *end == 0 && x >= std::numeric_limits<T>::min() && x <= std::numeric_limits<T>::max();
        if (ok) *out = static_cast<T>(x);
      }
    }
    if (!ok) {
      Error(path, v.line, absl::StrCat("'", s, "' is not a ", std::is_unsigned_v<T> ? "non-negative " : "",
                                       "whole number of at most ", std::numeric_limits<T>::max()));
    }
    return ok;
  }

  bool Real(const Node& v, const std::string& path, double* out) {
    if (v.kind != Node::Kind::kScalar) {
      Error(path, v.line, absl::StrCat("expected a number, got ", KindName(v.kind)));
      return false;
    }
    errno = 0;
    char* end = nullptr;
    const double x = std::strtod(v.scalar.c_str(), &end);
    if (v.scalar.empty() || *end != 0 || errno != 0 || !std::isfinite(x)) {
      Error(path, v.line, absl::StrCat("'", v.scalar, "' is not a finite number"));
      return false;
    }
    *out = x;
    return true;
  }

  const EnumValueDescriptor* EnumValue(const Node& v, const std::string& path, const EnumDescriptor* e) {
    if (v.kind != Node::Kind::kScalar) {
      Error(path, v.line, absl::StrCat("expected one of ", e->name(), "'s names, got ", KindName(v.kind)));
      return nullptr;
    }
    const std::string want = absl::AsciiStrToUpper(v.scalar);
    // The common prefix of the enum's names ("DTYPE_" in DTYPE_FP32, ...).
    std::string prefix = e->value(0)->name();
    for (int i = 1; i < e->value_count(); ++i) {
      const std::string& n = e->value(i)->name();
      size_t k = 0;
      while (k < prefix.size() && k < n.size() && prefix[k] == n[k]) ++k;
      prefix.resize(k);
    }
    prefix.resize(prefix.rfind('_') == std::string::npos ? 0 : prefix.rfind('_') + 1);
    std::vector<std::string> allowed;
    for (int i = 0; i < e->value_count(); ++i) {
      const EnumValueDescriptor* ev = e->value(i);
      const std::string& n = ev->name();
      const std::string shortname = n.substr(prefix.size());
      if (n.find("UNSPECIFIED") != std::string::npos) continue;
      if (want == n || want == shortname) return ev;
      allowed.push_back(absl::AsciiStrToLower(shortname));
    }
    Error(path, v.line, absl::StrCat("'", v.scalar, "' is not one of: ", absl::StrJoin(allowed, ", ")));
    return nullptr;
  }

  void SetOne(const Node& v, const std::string& path, const FieldDescriptor* f, Message* msg, bool add) {
    const Reflection* r = msg->GetReflection();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE: {
        Message* sub = add ? r->AddMessage(msg, f) : r->MutableMessage(msg, f);
        BindMessage(v, path, sub);
        return;
      }
      case FieldDescriptor::CPPTYPE_INT32: {
        int32_t x;
        if (Integer(v, path, &x)) add ? r->AddInt32(msg, f, x) : r->SetInt32(msg, f, x);
        return;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        int64_t x;
        if (Integer(v, path, &x)) add ? r->AddInt64(msg, f, x) : r->SetInt64(msg, f, x);
        return;
      }
      case FieldDescriptor::CPPTYPE_UINT32: {
        uint32_t x;
        if (Integer(v, path, &x)) add ? r->AddUInt32(msg, f, x) : r->SetUInt32(msg, f, x);
        return;
      }
      case FieldDescriptor::CPPTYPE_UINT64: {
        uint64_t x;
        if (Integer(v, path, &x)) add ? r->AddUInt64(msg, f, x) : r->SetUInt64(msg, f, x);
        return;
      }
      case FieldDescriptor::CPPTYPE_FLOAT:
      case FieldDescriptor::CPPTYPE_DOUBLE: {
        double x;
        if (!Real(v, path, &x)) return;
        if (f->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT) {
          add ? r->AddFloat(msg, f, static_cast<float>(x)) : r->SetFloat(msg, f, static_cast<float>(x));
        } else {
          add ? r->AddDouble(msg, f, x) : r->SetDouble(msg, f, x);
        }
        return;
      }
      case FieldDescriptor::CPPTYPE_BOOL: {
        if (v.kind == Node::Kind::kScalar) {
          const std::string s = absl::AsciiStrToLower(v.scalar);
          if (s == "true" || s == "yes" || s == "on" || s == "false" || s == "no" || s == "off") {
            const bool b = s == "true" || s == "yes" || s == "on";
            add ? r->AddBool(msg, f, b) : r->SetBool(msg, f, b);
            return;
          }
        }
        Error(path, v.line, "expected true or false");
        return;
      }
      case FieldDescriptor::CPPTYPE_ENUM: {
        const EnumValueDescriptor* ev = EnumValue(v, path, f->enum_type());
        if (ev != nullptr) add ? r->AddEnum(msg, f, ev) : r->SetEnum(msg, f, ev);
        return;
      }
      case FieldDescriptor::CPPTYPE_STRING: {
        if (v.kind != Node::Kind::kScalar) {
          Error(path, v.line, absl::StrCat("expected a string, got ", KindName(v.kind)));
          return;
        }
        add ? r->AddString(msg, f, v.scalar) : r->SetString(msg, f, v.scalar);
        return;
      }
    }
  }

  std::vector<std::string>* errors_;
};

}  // namespace

absl::Status ParseSpecText(std::string_view text, std::string_view source, Message* out) {
  Node root;
  ParseError err;
  if (!ParseDocument(text, &root, &err)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(source), ":", err.line, ": ", err.message));
  }
  std::vector<std::string> errors;
  Binder(&errors).BindMessage(root, "", out);
  if (!errors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(source), ": ", errors.size(), errors.size() == 1 ? " problem" : " problems", ":\n  ",
                     absl::StrJoin(errors, "\n  ")));
  }
  return absl::OkStatus();
}

absl::Status ParseSpecFile(const std::string& path, Message* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open spec file '", path, "'"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ParseSpecText(ss.str(), path, out);
}

}  // namespace fulcrum::config
