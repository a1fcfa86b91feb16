// The adaptive policy's per-row arithmetic (batchspec/spec/policy.py holds the same in
// Python, the reference this one is tested against): each row's per-depth acceptance
// estimates (SpecPolicy._depth_probs), the best plan of draft slots over the rows
// (SpecPolicy._plan) and the counting of a step's rounds in the estimates (SpecPolicy.record).
// In Python these ran at every speculating step over every row: 0.4 ms of a 6.3 ms step at
// 32 rows and 0.7 of 11.8 at 64 on a CPU with AMX tiles, 5-6% of a job's time.
//
// The estimates stay Python lists in Python dictionaries (tests and tools read them); this
// reads and writes them in place through the C API. Every sum and product is the Python
// code's, in its order, with no contraction into fused multiply-adds: the same floats.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace py = pybind11;

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// A (accepted, judged) pair of per-depth counts: two Python sequences, or none.
struct Counts {
  PyObject* acc = nullptr;   // borrowed
  PyObject* judged = nullptr;
  Py_ssize_t size = 0;
};

Counts counts_of(PyObject* pair) {
  Counts c;
  if (pair == nullptr || pair == Py_None) return c;
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
    throw py::type_error("an estimate is a tuple (accepted, judged)");
  c.acc = PyTuple_GET_ITEM(pair, 0);
  c.judged = PyTuple_GET_ITEM(pair, 1);
  if (!PyList_Check(c.acc) || !PyList_Check(c.judged))
    throw py::type_error("an estimate's counts are lists");
  c.size = PyList_GET_SIZE(c.judged);
  if (PyList_GET_SIZE(c.acc) < c.size)
    throw py::value_error("an estimate has fewer accepted counts than judged ones");
  return c;
}

double number(PyObject* list, Py_ssize_t i) {
  PyObject* x = PyList_GET_ITEM(list, i);
  double v = PyFloat_Check(x) ? PyFloat_AS_DOUBLE(x) : PyFloat_AsDouble(x);
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// policy.position_band's twin (tests/test_policy_core.py holds them equal over outputs of
// up to thousands of tokens): the band of output positions of a round after num_output
// tokens (0 for a row's first 16, then one per doubling, up to most), or -1 where no band
// is kept (most 0)
long position_band(long num_output, long most) {
  if (most <= 0) return -1;
  const long bits = num_output > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(num_output))
                                   : 0;
  return std::min(std::max(0L, bits - 4), most);
}

// key + (band,): the key of a domain's estimates at a band of output positions
py::object band_key(PyObject* dom_key, long band) {
  py::tuple extra = py::make_tuple(band);
  PyObject* key = PySequence_Concat(dom_key, extra.ptr());
  if (key == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(key);
}

Counts pooled_counts(PyObject* pooled, PyObject* key) {
  PyObject* pair = PyDict_GetItemWithError(pooled, key);   // borrowed
  if (pair == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return counts_of(pair);
}

// One shrinkage step: the estimate p shrunk towards counts at depth d with `prior` rounds.
inline double shrink(const Counts& c, Py_ssize_t d, double p, double prior) {
  return (number(c.acc, d) + prior * p) / (number(c.judged, d) + prior);
}

// Per row (own, src_key, dom_key, num_output_tokens, n): SpecPolicy._depth_probs. own: the
// row's (accepted, judged) for its source or None; max_band: MAX_POSITION_BAND (0: no
// estimates per band of output positions). priors: (PRIOR_P, PRIOR_ROUNDS,
// DOMAIN_PRIOR_ROUNDS, BAND_PRIOR_ROUNDS, REQUEST_PRIOR_ROUNDS, MAX_P).
py::list depth_probs_rows(py::dict pooled, py::list rows, py::tuple priors, long max_band) {
  const double prior_p = priors[0].cast<double>(), src_r = priors[1].cast<double>(),
               dom_r = priors[2].cast<double>(), band_r = priors[3].cast<double>(),
               own_r = priors[4].cast<double>(), max_p = priors[5].cast<double>();
  const Py_ssize_t num_rows = PyList_GET_SIZE(rows.ptr());
  py::list out(num_rows);
  for (Py_ssize_t i = 0; i < num_rows; ++i) {
    PyObject* row = PyList_GET_ITEM(rows.ptr(), i);
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 5)
      throw py::type_error("a row is (own, src_key, dom_key, num_output_tokens, n)");
    Counts own = counts_of(PyTuple_GET_ITEM(row, 0));
    PyObject* dom_key = PyTuple_GET_ITEM(row, 2);
    Counts src = pooled_counts(pooled.ptr(), PyTuple_GET_ITEM(row, 1));
    Counts dom = pooled_counts(pooled.ptr(), dom_key);
    const long band = position_band(PyLong_AsLong(PyTuple_GET_ITEM(row, 3)), max_band);
    const long n = PyLong_AsLong(PyTuple_GET_ITEM(row, 4));
    if (PyErr_Occurred()) throw py::error_already_set();
    Counts at_band;
    if (band >= 0) at_band = pooled_counts(pooled.ptr(), band_key(dom_key, band).ptr());
    PyObject* probs = PyList_New(n);
    if (probs == nullptr) throw py::error_already_set();
    out[i] = py::reinterpret_steal<py::object>(probs);
    double p = prior_p;
    for (Py_ssize_t d = 0; d < n; ++d) {
      if (d < src.size) p = shrink(src, d, p, src_r);
      if (d < dom.size) p = shrink(dom, d, p, dom_r);
      if (d < at_band.size) p = shrink(at_band, d, p, band_r);
      if (d < own.size) p = shrink(own, d, p, own_r);
      p = std::min(p, max_p);
      PyList_SET_ITEM(probs, d, PyFloat_FromDouble(p));
    }
  }
  return out;
}

// SpecPolicy._plan over rows' depth probabilities. skip: a row per entry, true to leave it
// out; sampled: per row, what a slot adds when sampled; unit: per row, a slot's price (None:
// slots ordered by survival alone); model: per row, its model draft's index in marginal, -1
// for a lookup; marginal[m][c]: one more row in draft m's forward over c rows; windows[n]:
// the target's time for n slots. Returns (slots, rate, tokens, seconds, order, row, depth,
// lengths).
py::tuple plan(
    py::list probs, std::vector<bool> skip, std::vector<double> sampled, py::object unit_obj,
    std::vector<int64_t> model, py::list marginal, py::list windows, int64_t num_rows,
    double extra_s) {
  const size_t n_rows = static_cast<size_t>(PyList_GET_SIZE(probs.ptr()));
  if (skip.size() != n_rows || sampled.size() != n_rows || model.size() != n_rows)
    throw py::value_error("plan: one entry per row");
  std::vector<double> survive;
  std::vector<int64_t> depth, row;
  for (size_t i = 0; i < n_rows; ++i) {
    if (skip[i]) continue;
    PyObject* rp = PyList_GET_ITEM(probs.ptr(), i);
    if (!PyList_Check(rp)) throw py::type_error("a row's probabilities are a list");
    double sp = 1.0;
    for (Py_ssize_t d = 0; d < PyList_GET_SIZE(rp); ++d) {
      sp *= number(rp, d);
      survive.push_back(sp);
      depth.push_back(d);
      row.push_back(static_cast<int64_t>(i));
    }
  }
  std::vector<int64_t> lengths(n_rows, 0);
  if (survive.empty())
    return py::make_tuple(0, 0.0, 0.0, 0.0, py::list(), py::cast(row), py::cast(depth),
                          py::cast(lengths));
  const size_t num_slots = survive.size();
  std::vector<int64_t> order(num_slots);
  for (size_t j = 0; j < num_slots; ++j) order[j] = static_cast<int64_t>(j);
  if (row.back() != row.front()) {
    // by (-survival per second of cost, depth, row): the Python sort's keys (the slot's
    // index never decides: (row, depth) pairs are unique)
    std::vector<double> key(num_slots);
    if (!unit_obj.is_none()) {
      auto unit = unit_obj.cast<std::vector<double>>();
      if (unit.size() != n_rows) throw py::value_error("plan: one unit per row");
      for (size_t j = 0; j < num_slots; ++j) key[j] = -survive[j] / unit[row[j]];
    } else {
      for (size_t j = 0; j < num_slots; ++j) key[j] = -survive[j];
    }
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      if (key[a] != key[b]) return key[a] < key[b];
      if (depth[a] != depth[b]) return depth[a] < depth[b];
      return row[a] < row[b];
    });
  }
  int64_t max_depth = 0;
  for (int64_t d : depth) max_depth = std::max(max_depth, d + 1);
  // (marginal's and windows' lists are read where a slot needs them, not converted whole:
  // at 64 rows the target's windows are 257 numbers, and a plan reads a few of them)
  const Py_ssize_t num_models = PyList_GET_SIZE(marginal.ptr());
  std::vector<PyObject*> marginal_of(num_models);
  for (Py_ssize_t i = 0; i < num_models; ++i) {
    marginal_of[i] = PyList_GET_ITEM(marginal.ptr(), i);
    if (!PyList_Check(marginal_of[i])) throw py::type_error("a draft's marginal is a list");
  }
  for (int64_t m : model) {
    if (m >= num_models) throw py::value_error("plan: a row's model draft has no marginal");
  }
  std::vector<std::vector<int64_t>> level(num_models, std::vector<int64_t>(max_depth, 0));
  const Py_ssize_t num_windows = PyList_GET_SIZE(windows.ptr());
  if (num_windows == 0) throw py::value_error("plan: no windows");
  const size_t most = static_cast<size_t>(num_windows - 1);
  double best_rate = -1.0, kept = 0.0, drafts = 0.0, best_tokens = 0.0, best_s = 0.0;
  size_t best = 0;
  for (size_t n = 1; n <= num_slots; ++n) {
    const int64_t j = order[n - 1];
    kept += survive[j];
    const int64_t m = model[row[j]];
    if (m >= 0) {
      const int64_t c = level[m][depth[j]]++;
      if (c >= PyList_GET_SIZE(marginal_of[m])) throw py::value_error("plan: marginal short");
      drafts += number(marginal_of[m], c);
    }
    drafts += sampled[row[j]];
    const double sec = number(windows.ptr(), static_cast<Py_ssize_t>(std::min(n, most))) +
                       drafts;
    const double tokens = static_cast<double>(num_rows) + kept;
    const double rate = tokens / std::max(sec + extra_s, 1e-12);
    if (rate > best_rate) {
      best_rate = rate;
      best = n;
      best_tokens = tokens;
      best_s = sec;
    }
  }
  for (size_t n = 0; n < best; ++n) {
    const int64_t j = order[n];
    lengths[row[j]] = std::max(lengths[row[j]], depth[j] + 1);
  }
  return py::make_tuple(best, best_tokens / std::max(best_s, 1e-12), best_tokens, best_s,
                        py::cast(order), py::cast(row), py::cast(depth), py::cast(lengths));
}

// list[i] = list[i] + 1 or * factor, keeping Python's types (an int stays an int while it is
// only counted)
void add_one(PyObject* list, Py_ssize_t i) {
  PyObject* x = PyList_GET_ITEM(list, i);
  PyObject* y;
  if (PyLong_CheckExact(x)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    y = overflow ? PyNumber_Add(x, py::int_(1).ptr()) : PyLong_FromLongLong(v + 1);
  } else {
    y = PyFloat_FromDouble(PyFloat_AsDouble(x) + 1.0);
  }
  if (y == nullptr || PyErr_Occurred()) throw py::error_already_set();
  PyList_SetItem(list, i, y);   // steals y, drops x
}

void scale(PyObject* list, Py_ssize_t i, double factor) {
  PyObject* y = PyFloat_FromDouble(PyFloat_AsDouble(PyList_GET_ITEM(list, i)) * factor);
  if (y == nullptr || PyErr_Occurred()) throw py::error_already_set();
  PyList_SetItem(list, i, y);
}

// pooled[key], made an empty (accepted, judged) pair first if missing
Counts pool(PyObject* pooled, PyObject* key) {
  PyObject* pair = PyDict_GetItemWithError(pooled, key);
  if (pair == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    py::tuple fresh = py::make_tuple(py::list(), py::list());
    if (PyDict_SetItem(pooled, key, fresh.ptr()) != 0) throw py::error_already_set();
    pair = fresh.ptr();   // (the dict holds it)
  }
  return counts_of(pair);
}

void count(Counts c, long num_drafted, long num_accepted) {
  py::int_ zero(0);
  while (PyList_GET_SIZE(c.judged) < num_drafted) {
    if (PyList_Append(c.acc, zero.ptr()) != 0 || PyList_Append(c.judged, zero.ptr()) != 0)
      throw py::error_already_set();
  }
  for (long d = 0; d < std::min(num_drafted, num_accepted + 1); ++d) {
    add_one(c.judged, d);
    if (d < num_accepted) add_one(c.acc, d);
  }
}

// Per round (own, src_key, dom_key, num_output_tokens, num_drafted, num_accepted):
// SpecPolicy.record's counting (its classes are counted in Python). own: the row's
// (accepted, judged) for the round's source, whose earlier rounds' counts decay by `decay`
// first; max_band as for depth_probs_rows.
void record_rows(py::dict pooled, py::list rounds, double decay, long max_band) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rounds.ptr()); ++i) {
    PyObject* r = PyList_GET_ITEM(rounds.ptr(), i);
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 6)
      throw py::type_error("a round is (own, src_key, dom_key, num_output_tokens, drafted, "
                           "accepted)");
    const long band = position_band(PyLong_AsLong(PyTuple_GET_ITEM(r, 3)), max_band);
    const long num_drafted = PyLong_AsLong(PyTuple_GET_ITEM(r, 4));
    const long num_accepted = PyLong_AsLong(PyTuple_GET_ITEM(r, 5));
    if (PyErr_Occurred()) throw py::error_already_set();
    if (num_drafted <= 0) continue;
    Counts own = counts_of(PyTuple_GET_ITEM(r, 0));
    if (own.acc == nullptr) throw py::type_error("a round's own counts are missing");
    for (Py_ssize_t d = 0; d < own.size; ++d) {
      scale(own.acc, d, decay);
      scale(own.judged, d, decay);
    }
    PyObject* dom_key = PyTuple_GET_ITEM(r, 2);
    count(own, num_drafted, num_accepted);
    count(pool(pooled.ptr(), PyTuple_GET_ITEM(r, 1)), num_drafted, num_accepted);
    count(pool(pooled.ptr(), dom_key), num_drafted, num_accepted);
    if (band >= 0) count(pool(pooled.ptr(), band_key(dom_key, band).ptr()), num_drafted,
                         num_accepted);
  }
}

}  // namespace

void register_policy_core(py::module& m) {
  m.def("depth_probs_rows", &depth_probs_rows, py::arg("pooled"), py::arg("rows"),
        py::arg("priors"), py::arg("max_band"));
  m.def("plan", &plan, py::arg("probs"), py::arg("skip"), py::arg("sampled"),
        py::arg("unit").none(true), py::arg("model"), py::arg("marginal"),
        py::arg("windows"), py::arg("num_rows"), py::arg("extra_s"));
  m.def("record_rows", &record_rows, py::arg("pooled"), py::arg("rounds"), py::arg("decay"),
        py::arg("max_band"));
}
