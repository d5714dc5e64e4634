// PULSELOCO_FAULT's syntax: every field parses, and bad input is refused with a message that
// names what was wrong.
#include <pulseloco/engine/fault_injection.h>

#include <gtest/gtest.h>

#include <string>

#include <pulseloco/base/errors.h>

namespace pulseloco {
namespace {

std::string error_of(std::string_view text) {
  try {
    (void)parse_fault_plan(text);
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "no error";
}

TEST(FaultPlan, ParsesEveryField) {
  const FaultPlan plan =
      parse_fault_plan(" window=12 , phase=aggregate,action=disconnect,rank=3,worker=w7");
  EXPECT_EQ(plan.window, 12u);
  EXPECT_EQ(plan.phase, WindowPhase::aggregate);
  EXPECT_EQ(plan.action, FaultAction::disconnect);
  EXPECT_EQ(plan.rank, 3);
  EXPECT_EQ(plan.worker, "w7");
  EXPECT_TRUE(plan.matches(12, WindowPhase::aggregate, 3, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::aggregate, 2, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::gate, 3, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::aggregate, 3, "w6"));
}

TEST(FaultPlan, EveryNameParsesBackToItsValue) {
  for (const WindowPhase phase : {WindowPhase::gate, WindowPhase::exchange, WindowPhase::aggregate}) {
    const auto text = "window=0,action=kill,phase=" + std::string(window_phase_name(phase));
    EXPECT_EQ(parse_fault_plan(text).phase, phase) << text;
  }
  for (const FaultAction action :
       {FaultAction::kill, FaultAction::stall, FaultAction::disconnect}) {
    const auto text = "window=0,phase=gate,action=" + std::string(fault_action_name(action));
    EXPECT_EQ(parse_fault_plan(text).action, action) << text;
  }
}

TEST(FaultPlan, BadInputIsRefusedNamingWhatWasWrong) {
  EXPECT_EQ(
      error_of("window=1,phase=apply,action=kill"),
      "invalid argument: PULSELOCO_FAULT: phase 'apply' is not one of gate, exchange, aggregate");
  EXPECT_EQ(
      error_of("window=1,phase=gate,action=crash"),
      "invalid argument: PULSELOCO_FAULT: action 'crash' is not one of kill, stall, disconnect");
  EXPECT_NE(error_of("window=-1,phase=gate,action=kill").find("window='-1'"), std::string::npos);
  EXPECT_NE(error_of("window=1,phase=gate,action=kill,color=red").find("unknown key 'color'"),
            std::string::npos);
  EXPECT_NE(error_of("window=1,phase").find("'phase' is not key=value"), std::string::npos);
  EXPECT_NE(error_of("window=1,phase=gate").find("needs window=, phase= and action="),
            std::string::npos);
}

}  // namespace
}  // namespace pulseloco
