// lade_host: a C++ program that embeds the lade-export runtime.
//
// It starts a Python interpreter (the virtual environment where lade-export is
// installed), loads a built artifact once with its scheduler (continuous batching:
// lade_export.load(..., batching=True)), and serves several requests at once from C++
// threads. Each request's text streams to a C++ callback; one request is cancelled
// midway; a bad request turns into a C++ exception carrying the runtime's one-line
// message. Results are printed one JSON object per line on stdout; the streamed text
// and the scheduler's pass counters go to stderr.
//
// Usage: lade_host ARTIFACT_DIR [MAX_NEW_TOKENS] [--token-budget T] [--kv-tokens K]
//                  [--width-policy adaptive|profile] [--no-batching]
//
// MAX_NEW_TOKENS (default 64) is each request's cap. --token-budget (rows of a pass that
// holds decode steps), --kv-tokens (most tokens the KV pool holds over all requests) and
// --width-policy (how wide each request's lookahead step is under load: adaptive or
// profile) are the scheduler's options of those names, as in lade-export serve and
// lade-export triton (defaults: the scheduler's); --no-batching loads the model without a scheduler,
// each request then running its own passes on the shared engine. A bad value is one line
// on stderr (error: ...) and exit status 2.
//
// Threads, the scheduler and the GIL: the main thread releases the GIL once the model is
// loaded. The concurrent requests share forward passes: each pass carries the next step
// of every running request (each output equals the request's solo output). The
// scheduler has no thread of its own: a request thread waiting for its next chunk runs
// the next pass for all of them when no other thread is running one, and otherwise waits
// (with the GIL released). A request thread holds the GIL only while it calls into
// Python (starting the stream, taking the next chunk, the host work of a pass); ONNX
// Runtime releases it during each forward pass, and the C++ callback runs with the GIL
// released.

#include <pybind11/embed.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace lade {

// A runtime error raised in Python (lade_export.errors.*), as a C++ exception.
class Error : public std::runtime_error {
 public:
  Error(std::string type, const std::string& message)
      : std::runtime_error(message), type_(std::move(type)) {}
  const std::string& type() const { return type_; }

 private:
  std::string type_;
};

// Rethrow the Python exception being handled as lade::Error (type name + one-line message).
[[noreturn]] void rethrow(const py::error_already_set& err) {
  py::gil_scoped_acquire gil;
  std::string type = py::str(err.type().attr("__name__"));
  std::string message = py::str(err.value());
  throw Error(type, message);
}

// A cancellation flag the Python stream polls before each step (``cancel.is_set()``).
struct CancelFlag {
  std::atomic<bool> flag{false};
  bool is_set() const { return flag.load(); }
};

struct Stats {
  int steps = 0;
  int new_tokens = 0;
  double compression = 0.0;
  double decode_s = 0.0;
  double first_token_s = 0.0;
};

struct Result {
  std::string text;
  std::string stop_reason;
  Stats stats;
};

struct Request {
  std::string prompt;
  int max_new_tokens = 64;
  std::optional<std::string> profile;  // none: the artifact's default profile
  bool lookahead = true;
};

// How the artifact is loaded: lade_export.load's batching, token_budget, kv_tokens and
// width_policy (an unset option: the scheduler's default).
struct LoadOptions {
  bool batching = true;
  std::optional<int> token_budget;
  std::optional<int> kv_tokens;
  std::optional<std::string> width_policy;
};

// One loaded artifact; thread-safe: any thread may call stream() at the same time.
class Model {
 public:
  Model(const std::string& artifact_dir, const LoadOptions& options) {
    py::gil_scoped_acquire gil;
    try {
      py::dict kwargs;
      kwargs["batching"] = options.batching;
      if (options.token_budget) kwargs["token_budget"] = *options.token_budget;
      if (options.kv_tokens) kwargs["kv_tokens"] = *options.kv_tokens;
      if (options.width_policy) kwargs["width_policy"] = *options.width_policy;
      model_ = py::module_::import("lade_export").attr("load")(artifact_dir, **kwargs);
    } catch (py::error_already_set& err) {
      rethrow(err);
    }
  }

  ~Model() {
    py::gil_scoped_acquire gil;
    model_ = py::object();
  }

  // Run one request, calling on_text(piece) for every released piece of text (with the
  // GIL released). Setting cancel->flag from any thread stops it before its next step.
  Result stream(const Request& req, const std::function<void(const std::string&)>& on_text,
                CancelFlag* cancel) {
    py::gil_scoped_acquire gil;
    try {
      py::dict kwargs;
      kwargs["max_new_tokens"] = req.max_new_tokens;
      kwargs["lookahead"] = req.lookahead;
      if (req.profile) kwargs["profile"] = *req.profile;
      if (cancel) kwargs["cancel"] = py::cast(cancel, py::return_value_policy::reference);
      py::object stream = model_.attr("stream")(req.prompt, **kwargs);
      Result result;
      for (py::handle chunk : stream) {
        std::string piece = py::str(chunk.attr("text"));
        result.text += piece;
        if (!piece.empty()) {
          py::gil_scoped_release release;
          on_text(piece);
        }
      }
      py::object r = stream.attr("result");
      py::object s = r.attr("stats");
      result.stop_reason = py::str(r.attr("stop_reason"));
      result.stats.steps = s.attr("steps").cast<int>();
      result.stats.new_tokens = s.attr("new_tokens").cast<int>();
      result.stats.compression = s.attr("compression_ratio").cast<double>();
      result.stats.decode_s = s.attr("decode_s").cast<double>();
      result.stats.first_token_s = s.attr("first_token_s").cast<double>();
      return result;
    } catch (py::error_already_set& err) {
      rethrow(err);
    }
  }

  // The scheduler's counters as one JSON object: passes run, passes that carried more
  // than one request, the most requests one pass carried, and its options as applied
  // (max_batch, token_budget, kv_tokens, width_policy); {"scheduler": null} without one (--no-batching).
  std::string scheduler_json() const {
    py::gil_scoped_acquire gil;
    py::object json = py::module_::import("json");
    py::object s = model_.attr("scheduler");
    py::dict line;
    if (s.is_none()) {
      line["scheduler"] = py::none();
      return py::str(json.attr("dumps")(line));
    }
    py::dict shapes(s.attr("pass_shapes"));  // (requests, rows) -> passes
    int shared = 0, most = 0;
    for (auto item : shapes) {
      int requests = item.first.cast<py::tuple>()[0].cast<int>();
      if (requests > 1) shared += item.second.cast<int>();
      most = std::max(most, requests);
    }
    py::dict d;
    d["passes"] = s.attr("passes");
    d["shared_passes"] = shared;
    d["most_requests_per_pass"] = most;
    for (const char* option : {"max_batch", "token_budget", "kv_tokens"}) d[option] = s.attr(option);
    d["width_policy"] = s.attr("width_policy").attr("name");  // the option that names the scheduler's policy
    line["scheduler"] = d;
    return py::str(json.attr("dumps")(line));
  }

 private:
  py::object model_;
};

}  // namespace lade

PYBIND11_EMBEDDED_MODULE(lade_host, m) {
  py::class_<lade::CancelFlag>(m, "CancelFlag").def("is_set", &lade::CancelFlag::is_set);
}

namespace {

// Start the interpreter of the virtual environment that has lade-export: LADE_PYTHON,
// else the interpreter CMake was configured with. Its path lets Python find the
// environment's pyvenv.cfg and site-packages.
PyConfig interpreter_config() {
  PyConfig config;
  PyConfig_InitPythonConfig(&config);
  const char* python = std::getenv("LADE_PYTHON");
  if (python == nullptr || *python == '\0') python = LADE_DEFAULT_PYTHON;
  PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, python);
  if (PyStatus_Exception(status)) throw std::runtime_error("cannot set the Python program name");
  config.install_signal_handlers = 0;  // the host owns SIGINT
  return config;
}

std::string json_line(int id, const lade::Request& req, const lade::Result& r, const std::string& error) {
  py::gil_scoped_acquire gil;
  py::dict d;
  d["id"] = id;
  d["prompt"] = req.prompt;
  d["profile"] = req.lookahead ? (req.profile ? py::cast(*req.profile) : py::none()) : py::cast("greedy");
  if (!error.empty()) {
    d["error"] = error;
  } else {
    d["text"] = r.text;
    d["stop_reason"] = r.stop_reason;
    d["steps"] = r.stats.steps;
    d["new_tokens"] = r.stats.new_tokens;
    d["compression"] = r.stats.compression;
    d["decode_s"] = r.stats.decode_s;
    d["first_token_s"] = r.stats.first_token_s;
  }
  return py::str(py::module_::import("json").attr("dumps")(d, py::arg("ensure_ascii") = false));
}

const char* const kUsage =
    "usage: lade_host ARTIFACT_DIR [MAX_NEW_TOKENS] [--token-budget T] [--kv-tokens K] "
    "[--width-policy adaptive|profile] [--no-batching]";

// A bad command line: its message is the one line the host prints after "error: ".
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Arguments {
  std::string artifact;
  int max_new_tokens = 64;
  lade::LoadOptions load;
};

// A count from the command line: decimal digits only, least (1 unless given) to INT_MAX.
int parse_count(const std::string& what, const std::string& text, long long least = 1) {
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  errno = 0;
  const long long value = digits ? std::strtoll(text.c_str(), nullptr, 10) : 0;
  if (!digits || errno == ERANGE || value < least || value > INT_MAX)
    throw UsageError(what + " must be an integer from " + std::to_string(least) + " to " + std::to_string(INT_MAX) +
                     ", got '" + text + "'");
  return static_cast<int>(value);
}

// ARTIFACT_DIR [MAX_NEW_TOKENS] and the options, in any order ("--option VALUE" or
// "--option=VALUE"). Throws UsageError.
Arguments parse_arguments(int argc, char** argv) {
  Arguments args;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      positional.push_back(arg);
      continue;
    }
    std::string name = arg, value;
    const size_t eq = arg.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    if (name == "--no-batching") {
      if (inline_value) throw UsageError("--no-batching takes no value");
      args.load.batching = false;
    } else if (name == "--token-budget" || name == "--kv-tokens") {
      if (!inline_value) {
        if (i + 1 == argc) throw UsageError(name + " needs a value");
        value = argv[++i];
      }
      if (name == "--token-budget") args.load.token_budget = parse_count(name, value);
      else args.load.kv_tokens = parse_count(name, value, 2);  // a prompt's token and the one it makes, as kv_tokens
    } else if (name == "--width-policy") {
      if (!inline_value) {
        if (i + 1 == argc) throw UsageError(name + " needs a value");
        value = argv[++i];
      }
      if (value != "adaptive" && value != "profile")
        throw UsageError("--width-policy must be adaptive or profile, got '" + value + "'");
      args.load.width_policy = value;
    } else {
      throw UsageError("unknown option " + name +
                       " (options: --token-budget T, --kv-tokens K, --width-policy P, --no-batching)");
    }
  }
  if (positional.empty()) throw UsageError("give the artifact directory: " + std::string(kUsage));
  if (positional.size() > 2) throw UsageError("unexpected argument '" + positional[2] + "': " + kUsage);
  args.artifact = positional[0];
  if (positional.size() == 2) args.max_new_tokens = parse_count("MAX_NEW_TOKENS", positional[1]);
  if (!args.load.batching) {  // without a scheduler its options would be ignored: say so instead
    for (const auto& [flag, value] : {std::pair{"--token-budget", args.load.token_budget},
                                      std::pair{"--kv-tokens", args.load.kv_tokens}})
      if (value) throw UsageError(std::string(flag) + " is an option of the scheduler, and --no-batching loads none");
    if (args.load.width_policy)
      throw UsageError("--width-policy is an option of the scheduler, and --no-batching loads none");
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage << "\n";
    return 2;
  }
  Arguments args;
  try {
    args = parse_arguments(argc, argv);
  } catch (const UsageError& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 2;
  }
  const int max_new = args.max_new_tokens;

  PyConfig config = interpreter_config();
  py::scoped_interpreter interpreter{&config};
  py::module_::import("lade_host");  // register CancelFlag

  std::optional<lade::Model> model;
  try {
    model.emplace(args.artifact, args.load);
  } catch (const lade::Error& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 2;
  }

  std::vector<lade::Request> requests = {
      {"Once upon a time", max_new, std::string("default"), true},
      {"Tom and Sue went to the beach.", max_new, std::string("small"), true},
      {"The little dog", max_new, std::string("1,2,1,10"), true},
      {"One day, a girl named Lily", max_new, std::nullopt, false},  // plain greedy; cancelled midway
  };
  const size_t cancelled = 3;
  std::vector<lade::Result> results(requests.size());
  std::vector<std::string> errors(requests.size());
  std::vector<lade::CancelFlag> flags(requests.size());
  std::mutex print;

  {
    py::gil_scoped_release release;  // the request threads take the GIL as they need it
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] {
        int pieces = 0;
        auto on_text = [&](const std::string& piece) {
          ++pieces;
          if (i == cancelled && pieces == 3) flags[i].flag = true;  // cancel after three pieces
          std::lock_guard<std::mutex> lock(print);
          std::cerr << "[request " << i << "] " << piece << "\n";
        };
        try {
          results[i] = model->stream(requests[i], on_text, &flags[i]);
        } catch (const lade::Error& err) {
          errors[i] = err.type() + ": " + err.what();
        }
      });
    }
    for (auto& t : threads) t.join();
  }

  for (size_t i = 0; i < requests.size(); ++i) std::cout << json_line(int(i), requests[i], results[i], errors[i]) << "\n";
  std::cerr << "[scheduler] " << model->scheduler_json() << "\n";  // stdout: one line per request

  // A bad request reaches C++ as an exception with the runtime's message.
  lade::Request bad{"Once upon a time", max_new, std::string("no-such-profile"), true};
  try {
    py::gil_scoped_release release;
    model->stream(bad, [](const std::string&) {}, nullptr);
    std::cout << json_line(-1, bad, {}, "no exception") << "\n";
    return 1;
  } catch (const lade::Error& err) {
    std::cout << json_line(-1, bad, {}, err.type() + ": " + err.what()) << "\n";
  }
  model.reset();
  return 0;
}
