// The kernel's state: when its last cell ended ("last_cell_ended_ns"), which only a cell's end moves, whatever
// a park, a drain from outside or a background release do to the state after it.
#include "kernel_state.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

using gpucleanup::KernelState;
using gpucleanup::realtime_ns;
using json = nlohmann::json;

namespace {

bool no_drain() { return false; }

// One park step that must be accepted; the state after it.
json step(KernelState& kernel, const std::string& name, std::optional<std::int64_t> bytes = std::nullopt,
          const json* then = nullptr) {
  json after;
  const auto refused = kernel.park(name, bytes, after, then, false, no_drain);
  EXPECT_FALSE(refused.has_value()) << name << ": " << (refused ? refused->message : "");
  return after;
}

// A drain from outside as the kernel says it: "draining" of no cell (its cleanup, maybe "waiting" of no cell
// while it settles), then "idle" by the fast path (OutsideDrain's end).
void outside_drain(KernelState& kernel) {
  kernel.set(json{{"state", "draining"}, {"cell", nullptr}});
  kernel.set(json{{"state", "waiting"}, {"device", 0}, {"cell", nullptr}});
  kernel.set(json{{"state", "draining"}, {"cell", nullptr}});
  EXPECT_EQ(kernel.set_cell(false, -1), 0);
}

// The cell's end by the fast path, between two clock readings.
std::int64_t cell_by_fast_path(KernelState& kernel, std::int64_t cell, std::int64_t& before, std::int64_t& after) {
  EXPECT_EQ(kernel.set_cell(true, cell), 0);
  before = realtime_ns();
  EXPECT_EQ(kernel.set_cell(false, cell), 0);
  after = realtime_ns();
  return *kernel.last_cell_ended_ns();
}

}  // namespace

TEST(KernelState, NoCellHasEndedUntilOneDoesAndTheViewSaysNull) {
  KernelState kernel;
  EXPECT_FALSE(kernel.last_cell_ended_ns().has_value());
  EXPECT_TRUE(kernel.view(realtime_ns())["last_cell_ended_ns"].is_null());
  // Loaded from the config: idle said with no cell before it; then a drain from outside and a background release.
  kernel.set(json{{"state", "idle"}, {"since_ns", realtime_ns()}});
  outside_drain(kernel);
  EXPECT_EQ(kernel.background(true), 0);
  EXPECT_EQ(kernel.background(false), 0);
  EXPECT_FALSE(kernel.last_cell_ended_ns().has_value());
  EXPECT_TRUE(kernel.view(realtime_ns())["last_cell_ended_ns"].is_null());
}

TEST(KernelState, ACellsEndByTheFastPathIsKeptThroughAParkAndADrainFromOutside) {
  KernelState kernel;
  std::int64_t before = 0, after = 0;
  const std::int64_t ended = cell_by_fast_path(kernel, 3, before, after);
  EXPECT_GE(ended, before);
  EXPECT_LE(ended, after);

  outside_drain(kernel);
  EXPECT_EQ(kernel.background(true), 0);
  EXPECT_EQ(kernel.background(false), 0);
  EXPECT_EQ(step(kernel, "begin")["state"], "parking");
  EXPECT_EQ(step(kernel, "parked", 1 << 20)["state"], "parked");
  // A cell's state while parked is refused (the cell resumes first): it moves nothing.
  EXPECT_EQ(kernel.set_cell(true, 4), 2);
  EXPECT_EQ(kernel.set_cell(false, 4), 2);
  kernel.set(json{{"state", "idle"}});
  const json resumed = step(kernel, "resumed");  // from outside (gpucleanup resume): idle from now
  EXPECT_EQ(resumed["state"], "idle");
  outside_drain(kernel);

  const json view = kernel.view(realtime_ns());
  EXPECT_EQ(view["state"], "idle");
  EXPECT_GT(view["since_ns"].get<std::int64_t>(), ended);  // the state's age restarted: not the idle time
  EXPECT_EQ(view["last_cell_ended_ns"], ended);
}

TEST(KernelState, AFailedParkLeavesTheLastCellsEnd) {
  KernelState kernel;
  std::int64_t before = 0, after = 0;
  const std::int64_t ended = cell_by_fast_path(kernel, 1, before, after);
  step(kernel, "begin");
  EXPECT_EQ(step(kernel, "failed")["state"], "idle");
  EXPECT_EQ(kernel.last_cell_ended_ns(), ended);
}

TEST(KernelState, ARunningCellKeepsThePreviousEndUntilItsOwn) {
  KernelState kernel;
  std::int64_t before = 0, after = 0;
  const std::int64_t first = cell_by_fast_path(kernel, 1, before, after);
  EXPECT_EQ(kernel.set_cell(true, 2), 0);
  kernel.set(json{{"state", "waiting"}, {"device", 0}, {"cell", 2}});
  kernel.set(json{{"state", "draining"}, {"cell", 2}});
  const json running = kernel.view(realtime_ns());
  EXPECT_EQ(running["state"], "draining");
  EXPECT_EQ(running["last_cell_ended_ns"], first);
  const std::int64_t ends = realtime_ns();
  EXPECT_EQ(kernel.set_cell(false, 2), 0);
  const std::int64_t second = *kernel.last_cell_ended_ns();
  EXPECT_GE(second, ends);
  EXPECT_GT(second, first);
  // "idle" said again (a Ctrl-C in the hook's end says it once more): the end is counted once.
  EXPECT_EQ(kernel.set_cell(false, 2), 0);
  EXPECT_EQ(kernel.last_cell_ended_ns(), second);
}

TEST(KernelState, ACellsEndThroughTheObjectTakesTheTimeItSays) {
  KernelState kernel;
  kernel.set(json{{"state", "running"}, {"cell", 5}});
  EXPECT_FALSE(kernel.last_cell_ended_ns().has_value());
  const std::int64_t said = realtime_ns() - 2'000'000'000;  // "idle since" 2 s ago
  kernel.set(json{{"state", "idle"}, {"since_ns", said}});
  EXPECT_EQ(kernel.last_cell_ended_ns(), said);
  kernel.set(json{{"state", "idle"}, {"since_ns", realtime_ns()}});  // idle again: no new cell
  EXPECT_EQ(kernel.last_cell_ended_ns(), said);
  // A time ahead of the clock is the clock's at most: the kernel's idle time is never negative.
  kernel.set(json{{"state", "running"}, {"cell", 6}});
  const std::int64_t before = realtime_ns();
  kernel.set(json{{"state", "idle"}, {"since_ns", before + 3'600'000'000'000}});
  const std::int64_t after = realtime_ns();
  EXPECT_GE(*kernel.last_cell_ended_ns(), before);
  EXPECT_LE(*kernel.last_cell_ended_ns(), after);
}

TEST(KernelState, ACellThatOutwaitedADrainEndsWhenItSaysDrainingNotWhenTheDrainDoes) {
  KernelState kernel;
  kernel.set(json{{"state", "draining"}, {"cell", nullptr}});  // a drain from outside runs the kernel's cleanup
  EXPECT_EQ(kernel.set_cell(true, 9), 0);                       // a cell runs beside it
  const std::int64_t before = realtime_ns();
  kernel.set(json{{"state", "draining"}, {"cell", nullptr}, {"since_ns", realtime_ns()}});  // the cell's end
  const std::int64_t after = realtime_ns();
  ASSERT_TRUE(kernel.last_cell_ended_ns().has_value());
  const std::int64_t ended = *kernel.last_cell_ended_ns();
  EXPECT_GE(ended, before);
  EXPECT_LE(ended, after);
  EXPECT_EQ(kernel.set_cell(false, -1), 0);  // the drain's end: idle
  EXPECT_EQ(kernel.last_cell_ended_ns(), ended);
}

TEST(KernelState, ACellThatResumesAParkEndsAsAnyCell) {
  KernelState kernel;
  std::int64_t before = 0, after = 0;
  const std::int64_t first = cell_by_fast_path(kernel, 1, before, after);
  step(kernel, "begin");
  step(kernel, "parked", 7);
  EXPECT_EQ(kernel.set_cell(true, 2), 2);  // parked: the cell resumes the kernel first, into its own state
  const json running{{"state", "running"}, {"cell", 2}};
  EXPECT_EQ(step(kernel, "resumed", std::nullopt, &running)["state"], "running");
  EXPECT_EQ(kernel.last_cell_ended_ns(), first);  // the resume is no cell's end
  const std::int64_t ends = realtime_ns();
  EXPECT_EQ(kernel.set_cell(false, 2), 0);
  EXPECT_GE(*kernel.last_cell_ended_ns(), ends);
}

TEST(KernelState, TheEndOfARequestThatRanTheUsersCodeStartsAnIdleKernelsIdleTimeAgain) {
  KernelState kernel;
  const std::int64_t long_ago = realtime_ns() - 3600LL * 1000000000LL;
  kernel.set(json{{"state", "idle"}, {"since_ns", long_ago}});
  EXPECT_EQ(kernel.view(realtime_ns())["since_ns"], long_ago);
  // the kernel's own release: not activity, the idle time stays
  EXPECT_EQ(kernel.background(1), 0);
  EXPECT_EQ(kernel.background(0), 0);
  EXPECT_EQ(kernel.view(realtime_ns())["since_ns"], long_ago);
  // a completion (a request that ran the user's code): idle from its end, as Jupyter's culling clock counts it
  EXPECT_EQ(kernel.background(1), 0);
  const std::int64_t before = realtime_ns();
  EXPECT_EQ(kernel.background(2), 0);
  const json view = kernel.view(realtime_ns());
  EXPECT_GE(view["since_ns"].get<std::int64_t>(), before);
  EXPECT_LT(view["age_s"].get<double>(), 60.0);
  EXPECT_EQ(view["state"], "idle");
  EXPECT_TRUE(view["last_cell_ended_ns"].is_null()) << "only a cell's end moves it";
  // a running kernel's time is its cell's: a request beside it (the debugger's, on the control channel) keeps it
  std::int64_t b = 0, a = 0;
  cell_by_fast_path(kernel, 5, b, a);
  EXPECT_EQ(kernel.set_cell(true, 6), 0);
  const std::int64_t running_since = kernel.view(realtime_ns())["since_ns"].get<std::int64_t>();
  EXPECT_EQ(kernel.background(1), 0);
  EXPECT_EQ(kernel.background(2), 0);
  EXPECT_EQ(kernel.view(realtime_ns())["since_ns"], running_since);
  EXPECT_EQ(kernel.view(realtime_ns())["state"], "running");
}
