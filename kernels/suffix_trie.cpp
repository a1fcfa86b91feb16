// The depth-bounded suffix trie of suffix drafts (batchspec/spec/suffix.py has the same
// structure in Python, the reference this one is tested against): a node per distinct
// substring of at most `depth` tokens of the texts inserted, its count the number of
// occurrences. Every token a request or an output adds costs `depth` lookups; a job's rows
// add a prompt and an output each (and an output leaves the job-wide trie again), and in
// Python, with a dictionary per node, that upkeep was a large part of a speculating step at
// 32 rows and more. Here it is the same walk over flat arrays and one open-addressing table.
//
// Same results as the Python trie, ties included: a node's children are kept in the order
// they were first added (an emptied child is erased in place, not swapped), and the most
// frequent child is the first of the largest count, as Python's max() picks it.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// (node, token) -> child: open addressing with linear probing over flat arrays, deletion by
// backward shift (no tombstones), kept at most half full. One probe is usually one cache
// line; std::unordered_map's node per entry made a lookup a pointer chase.
class EdgeMap {
 public:
  EdgeMap() { rehash(1024); }

  int32_t find(uint64_t key) const {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == kEmpty) return -1;
      if (keys_[i] == key) return vals_[i];
    }
  }

  void insert(uint64_t key, int32_t value) {
    if (2 * (size_ + 1) > keys_.size()) rehash(2 * keys_.size());
    size_t i = slot(key);
    while (keys_[i] != kEmpty) i = (i + 1) & mask_;
    keys_[i] = key;
    vals_[i] = value;
    ++size_;
  }

  void erase(uint64_t key) {
    size_t i = slot(key);
    while (keys_[i] != key) i = (i + 1) & mask_;
    // shift back every later entry of the run that may sit before its home slot
    for (size_t j = (i + 1) & mask_; keys_[j] != kEmpty; j = (j + 1) & mask_) {
      const size_t home = slot(keys_[j]);
      if (((j - home) & mask_) >= ((j - i) & mask_)) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = kEmpty;
    --size_;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  size_t slot(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }

  void rehash(size_t capacity) {
    std::vector<uint64_t> keys(capacity, kEmpty);
    std::vector<int32_t> vals(capacity);
    keys.swap(keys_);
    vals.swap(vals_);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != kEmpty) insert(keys[i], vals[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t mask_ = 0, size_ = 0;
  int shift_ = 0;
};

struct SuffixTrie {
  explicit SuffixTrie(int64_t depth) : depth_(depth), kids_(1), count_(1, 0), open_{0} {}

  // Append tokens to this trie's own growing text (a request's prompt + output): the text's
  // open suffixes (its last 0 .. depth-1 tokens) each grow by one node per token.
  void extend(const std::vector<int64_t>& tokens) {
    for (int64_t t : tokens) append(open_, static_cast<int32_t>(t));
  }

  // Add a whole text (a finished output), independent of the growing one.
  void insert(const std::vector<int64_t>& tokens) {
    std::vector<int32_t> open{0};
    for (int64_t t : tokens) append(open, static_cast<int32_t>(t));
  }

  // Undo insert(tokens): counts drop, nodes left at zero are freed (a child never counts
  // more than its parent, so a freed node has no children left).
  void remove(const std::vector<int64_t>& tokens) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      int32_t node = 0;
      for (int64_t j = i; j < n && j < i + depth_; ++j) {
        const int32_t t = static_cast<int32_t>(tokens[j]);
        const int32_t child = edge_.find(key(node, t));
        TORCH_CHECK(child >= 0, "SuffixTrie.remove: text was not inserted");
        if (--count_[child] == 0) {
          edge_.erase(key(node, t));
          auto& kids = kids_[node];
          for (size_t k = 0; k < kids.size(); ++k) {
            if (kids[k].second == child) {
              kids.erase(kids.begin() + static_cast<std::ptrdiff_t>(k));
              break;
            }
          }
          free_.push_back(child);
        }
        node = child;
      }
    }
  }

  // The longest suffix of context (at most max_match tokens) occurring at least min_count
  // times, then its most frequent continuation, token by token, while the estimated
  // probability of the whole draft (the product of each token's share of its parent's
  // continuations) stays at least min_prob, for at most
  // min(max_len, ceil(match_factor * match length)) tokens. Returns (tokens, each token's
  // share, match length); none when nothing matches.
  using Draft = std::tuple<std::vector<int64_t>, std::vector<double>, int64_t>;
  Draft draft(const std::vector<int64_t>& context, int64_t max_match, int64_t min_count,
              int64_t max_len, double match_factor, double min_prob) const {
    const int64_t n = static_cast<int64_t>(context.size());
    // occurring is monotone in the length (a suffix of an occurring string occurs): binary
    // search over lengths
    int64_t lo = 0, hi = std::min(max_match, n);
    int32_t best = 0;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      const int32_t node = find(context, n - mid);
      if (node >= 0 && count_[node] >= min_count) {
        lo = mid;
        best = node;
      } else {
        hi = mid - 1;
      }
    }
    std::vector<int64_t> tokens;
    std::vector<double> shares;
    if (lo == 0) return {tokens, shares, 0};
    const int64_t cap =
        std::min<int64_t>(max_len, static_cast<int64_t>(std::ceil(match_factor * lo)));
    double prob = 1.0;
    int32_t node = best;
    while (static_cast<int64_t>(tokens.size()) < cap && !kids_[node].empty()) {
      int64_t total = 0;
      int32_t top = -1, top_count = 0;
      for (const auto& [t, child] : kids_[node]) {
        total += count_[child];
        if (count_[child] > top_count) top = t, top_count = count_[child];
      }
      const double share = static_cast<double>(top_count) / static_cast<double>(total);
      prob *= share;
      if (prob < min_prob) break;
      tokens.push_back(top);
      shares.push_back(share);
      node = edge_.find(key(node, top));
    }
    return {tokens, shares, lo};
  }

  // One row's draft in one call (each call from Python costs more than the walk): append
  // new_tokens to this request's text, then the better (preferred()) of this trie's draft,
  // whose match must occur twice (once is the text's own end), and the domain trie's, where
  // once is enough. Returns draft()'s triple.
  Draft propose(
      const std::vector<int64_t>& new_tokens, const std::vector<int64_t>& context,
      int64_t max_match, int64_t max_len, double match_factor, double min_prob,
      const SuffixTrie* domain) {
    extend(new_tokens);
    auto best = draft(context, max_match, 2, max_len, match_factor, min_prob);
    if (domain != nullptr) {
      auto other = domain->draft(context, max_match, 1, max_len, match_factor, min_prob);
      if (preferred(other, best)) best = std::move(other);
    }
    return best;
  }

  // Whether draft a is proposed over draft b (suffix.py's preferred(), the rule's
  // reasons there): a draft over none; else the longer match; on equal matches, more
  // expected accepted tokens; b on a tie.
  static bool preferred(const Draft& a, const Draft& b) {
    const bool a_drafts = !std::get<0>(a).empty(), b_drafts = !std::get<0>(b).empty();
    if (a_drafts != b_drafts) return a_drafts;
    if (std::get<2>(a) != std::get<2>(b)) return std::get<2>(a) > std::get<2>(b);
    return expected(std::get<1>(a)) > expected(std::get<1>(b));
  }

  static double expected(const std::vector<double>& shares) {
    double prob = 1.0, sum = 0.0;
    for (double s : shares) sum += (prob *= s);
    return sum;
  }

  int64_t num_nodes() const { return static_cast<int64_t>(count_.size() - free_.size()); }

  // For tests: a node's count, and its children as [token, child, token, child, ...] (first
  // added first).
  int64_t node_count(int64_t node) const { return count_.at(node); }
  std::vector<int64_t> edges(int64_t node) const {
    std::vector<int64_t> out;
    for (const auto& [t, child] : kids_.at(node)) out.insert(out.end(), {t, child});
    return out;
  }

 private:
  static uint64_t key(int32_t node, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) |
           static_cast<uint32_t>(token);
  }

  // node of context[start:], or -1
  int32_t find(const std::vector<int64_t>& context, int64_t start) const {
    int32_t node = 0;
    for (size_t i = static_cast<size_t>(start); i < context.size(); ++i) {
      node = edge_.find(key(node, static_cast<int32_t>(context[i])));
      if (node < 0) return -1;
    }
    return node;
  }

  // Extend a text by one token: open holds the nodes of its last 0, 1, ... tokens, shortest
  // first; each gets a child for `token` (counted once more) and those children are the
  // text's new open suffixes. O(depth).
  void append(std::vector<int32_t>& open, int32_t token) {
    std::vector<int32_t>& next = scratch_;
    next.assign(1, 0);
    for (int32_t node : open) {
      int32_t child = edge_.find(key(node, token));
      if (child < 0) {
        if (!free_.empty()) {
          child = free_.back();
          free_.pop_back();
          kids_[child].clear();
          count_[child] = 0;
        } else {
          child = static_cast<int32_t>(count_.size());
          kids_.emplace_back();
          count_.push_back(0);
        }
        edge_.insert(key(node, token), child);
        kids_[node].emplace_back(token, child);
      }
      ++count_[child];
      if (static_cast<int64_t>(next.size()) < depth_) next.push_back(child);
    }
    open.swap(next);
  }

  int64_t depth_;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> kids_;  // (token, child), first added first
  std::vector<int32_t> count_;
  EdgeMap edge_;                  // (node, token) -> child
  std::vector<int32_t> free_;
  std::vector<int32_t> open_;     // open suffixes of the growing text (extend)
  std::vector<int32_t> scratch_;
};


// A request's own text (prompt + output) for its suffix drafts: the same drafts as a
// SuffixTrie over that one text (extend() then draft(context, max_match, 2, ...)), found by
// scanning the text instead of keeping the trie. A trie grows `depth` nodes per token, each
// a hash-table insert to memory the target's forward has just evicted (with the caches
// written over, the source cost 42.7 us a row-step so, 17.7 scanning:
// benchmarks/bench_suffix.py --evict-mb 32). The scan reads the row's own tokens,
// contiguous, O(text) a step with an early exit at the first differing token; it holds 4
// bytes a token where the trie held ~83 per node.
//
// Why they agree: a string of the text occurs at least twice exactly when it also ends
// somewhere before the text's end; the trie's children of a string are the tokens after its
// occurrences, first added first, i.e. in the order of their first occurrence in the text;
// the last occurrence (the text's end) has no child. So the longest match is the longest
// common suffix of the text and any of its prefixes (at most max_match and depth tokens), and
// each draft token is the most frequent token after the current string's occurrences, ties
// to the earliest, as the trie's walk picks it.
struct RequestText {
  explicit RequestText(int64_t depth) : depth_(depth) {}

  void extend(const std::vector<int64_t>& tokens) {
    for (int64_t t : tokens) text_.push_back(static_cast<int32_t>(t));
  }

  // SuffixTrie::propose's draft, context being the text's last tokens as there.
  SuffixTrie::Draft propose(
      const std::vector<int64_t>& new_tokens, const std::vector<int64_t>& context,
      int64_t max_match, int64_t max_len, double match_factor, double min_prob,
      const SuffixTrie* domain) {
    extend(new_tokens);
    auto best = draft(std::min<int64_t>(max_match, static_cast<int64_t>(context.size())),
                      max_len, match_factor, min_prob);
    if (domain != nullptr) {
      auto other = domain->draft(context, max_match, 1, max_len, match_factor, min_prob);
      if (SuffixTrie::preferred(other, best)) best = std::move(other);
    }
    return best;
  }

  // The draft a trie over the text gives for the text's own end (min_count 2).
  SuffixTrie::Draft draft(int64_t max_match, int64_t max_len, double match_factor,
                          double min_prob) {
    const int64_t n = static_cast<int64_t>(text_.size());
    std::vector<int64_t> tokens;
    std::vector<double> shares;
    const int64_t cap_match = std::min({max_match, n, depth_});
    if (cap_match <= 0) return {tokens, shares, 0};
    const int32_t* t = text_.data();
    // the longest common suffix of text[..j] and the text, over j < n - 1
    std::vector<int32_t>& ends = ends_;
    std::vector<int32_t>& lens = lens_;
    ends.clear();
    lens.clear();
    int64_t m = 0;
    const int32_t last = t[n - 1];
    for (int64_t j = 0; j + 1 < n; ++j) {
      if (t[j] != last) continue;
      const int64_t lim = std::min<int64_t>(cap_match, j + 1);
      int64_t l = 1;
      while (l < lim && t[j - l] == t[n - 1 - l]) ++l;
      if (l >= m) {
        ends.push_back(static_cast<int32_t>(j));
        lens.push_back(static_cast<int32_t>(l));
        m = l;
      }
    }
    if (m == 0) return {tokens, shares, 0};
    // occurrences of the match, other than the text's end, by end position
    std::vector<int32_t>& occ = occ_;
    occ.clear();
    for (size_t i = 0; i < ends.size(); ++i)
      if (lens[i] == m) occ.push_back(ends[i]);
    const int64_t cap =
        std::min<int64_t>(max_len, static_cast<int64_t>(std::ceil(match_factor * m)));
    double prob = 1.0;
    // (token, count) of the next tokens, first seen first
    std::vector<std::pair<int32_t, int32_t>>& counts = counts_;
    while (static_cast<int64_t>(tokens.size()) < cap &&
           m + static_cast<int64_t>(tokens.size()) < depth_) {
      counts.clear();
      int64_t total = 0;
      for (int32_t j : occ) {
        if (j + 1 >= n) continue;
        const int32_t x = t[j + 1];
        ++total;
        bool seen = false;
        for (auto& c : counts) {
          if (c.first == x) {
            ++c.second;
            seen = true;
            break;
          }
        }
        if (!seen) counts.emplace_back(x, 1);
      }
      if (total == 0) break;
      int32_t top = -1, top_count = 0;
      for (const auto& c : counts)
        if (c.second > top_count) top = c.first, top_count = c.second;
      const double share = static_cast<double>(top_count) / static_cast<double>(total);
      prob *= share;
      if (prob < min_prob) break;
      tokens.push_back(top);
      shares.push_back(share);
      size_t w = 0;
      for (int32_t j : occ)
        if (j + 1 < n && t[j + 1] == top) occ[w++] = j + 1;
      occ.resize(w);
    }
    return {tokens, shares, m};
  }

  int64_t size() const { return static_cast<int64_t>(text_.size()); }

 private:
  int64_t depth_;
  std::vector<int32_t> text_;
  std::vector<int32_t> ends_, lens_, occ_;                    // scratch of draft()
  std::vector<std::pair<int32_t, int32_t>> counts_;
};

}  // namespace

void register_policy_core(pybind11::module& m);   // policy_core.cpp

// A Python class (pybind11), not a torch custom class: a step calls it once per row, and a
// torch.classes method call costs several microseconds of boxing, more than the walk.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<SuffixTrie>(m, "SuffixTrie")
      .def(py::init<int64_t>(), py::arg("depth"))
      .def("extend", &SuffixTrie::extend)
      .def("insert", &SuffixTrie::insert)
      .def("remove", &SuffixTrie::remove)
      .def("draft", &SuffixTrie::draft)
      .def("propose", &SuffixTrie::propose, py::arg("new_tokens"), py::arg("context"),
           py::arg("max_match"), py::arg("max_len"), py::arg("match_factor"),
           py::arg("min_prob"), py::arg("domain").none(true))
      .def("num_nodes", &SuffixTrie::num_nodes)
      .def("node_count", &SuffixTrie::node_count)
      .def("edges", &SuffixTrie::edges);
  py::class_<RequestText>(m, "RequestText")
      .def(py::init<int64_t>(), py::arg("depth"))
      .def("extend", &RequestText::extend)
      .def("draft", &RequestText::draft, py::arg("max_match"), py::arg("max_len"),
           py::arg("match_factor"), py::arg("min_prob"))
      .def("propose", &RequestText::propose, py::arg("new_tokens"), py::arg("context"),
           py::arg("max_match"), py::arg("max_len"), py::arg("match_factor"),
           py::arg("min_prob"), py::arg("domain").none(true))
      .def("__len__", &RequestText::size);
  register_policy_core(m);
}
