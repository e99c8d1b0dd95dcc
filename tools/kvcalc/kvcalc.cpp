#include "kvcalc.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "args.hpp"
#include "json_output.hpp"
#include "model.hpp"
#include "svg.hpp"
#include "table.hpp"
#include "text.hpp"

namespace kvcalc {
namespace {

void write_file(const std::string& path, const std::string& content) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) fail("--svg '" + path + "' cannot be written: " + std::strerror(errno));
  file << content;
  file.close();
  if (!file) fail("--svg '" + path + "' could not be written completely");
}

/// Computes everything, then writes: there is never a partial table.
int run_or_throw(const std::vector<std::string>& args, const Io& io) {
  const ConfigReader read_config = [&io](const std::string& path) {
    an::HfReadOptions options;
    options.label = "--hf-config '" + path + "'";
    return shape_of(io.read_config(path, options));
  };
  std::ostringstream out;
  const std::optional<Options> parsed = parse_args(args, out, read_config);
  if (!parsed) {
    *io.out << out.str() << std::flush;
    return 0;
  }
  const Options& o = *parsed;
  const Resolved r = resolve(o);
  const std::vector<Row> rows = compute_rows(o, r);
  std::optional<BudgetResult> budget;
  if (o.budget) budget = solve_budget(*o.budget, o, r);

  if (o.json) {
    out << to_json_text(o, r, rows, budget);
  } else {
    print_table(out, o, r, rows, budget);
  }
  if (o.svg_path) {
    io.write_file(*o.svg_path, to_svg(o, r, rows));
    if (!o.json) out << "\nWrote " << *o.svg_path << "\n";
  }
  *io.out << out.str() << std::flush;
  return 0;
}

}  // namespace

Io system_io() {
  Io io;
  io.out = &std::cout;
  io.err = &std::cerr;
  io.read_config = [](const std::string& path, const an::HfReadOptions& options) {
    return an::read_hf_config(path, options);
  };
  io.write_file = write_file;
  return io;
}

Shape shape_of(const an::HfModel& model) {
  Shape s;
  s.source = model.name;
  s.heads = model.n_heads();
  s.layers = model.layers();
  s.d_model = model.d_model();
  s.head_dim = model.head_dim();
  s.own = std::string(an::to_string(model.attention));
  if (model.mla) {
    s.kv_rank = model.mla->kv_rank;
    s.q_rank = model.mla->q_rank;
    s.rope_dim = model.mla->rope_dim;
    s.v_dim = model.mla->v_dim;
  } else if (model.attention == an::HfAttention::gqa) {
    s.kv_heads = model.gqa->n_kv_heads;  // MHA / MQA models compare with the default GQA
  }
  if (model.stack.window_layers > 0) {
    s.window = model.stack.window;
    s.window_layers = model.stack.window_layers;
  }
  s.dtype = model.dtype;
  s.notes = model.notes;
  return s;
}

int run(const std::vector<std::string>& args, const Io& io) {
  std::string error;
  try {
    return run_or_throw(args, io);
  } catch (const InputError& e) {
    error = e.what();
  } catch (const kvattn::hf_config_error& e) {
    error = e.what();  // names the file and the field already
  } catch (const kvattn::config_error& e) {
    error = std::string("impossible configuration: ") + e.what();
  } catch (const std::overflow_error& e) {
    error = std::string("a number is too large to represent: ") + e.what() +
            "; use a smaller --seq-len, --batch or model";
  } catch (const std::exception& e) {
    error = e.what();
  }
  *io.err << "kvcalc: error: " << one_line(error) << "\n" << std::flush;
  return 2;
}

}  // namespace kvcalc
