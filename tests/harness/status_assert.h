// GoogleTest assertions for absl::Status / absl::StatusOr, for tests that
// drive the harness (whose calls return Status instead of asserting).
// Header only; no state.
#ifndef OPTIMUS_TESTS_HARNESS_STATUS_ASSERT_H_
#define OPTIMUS_TESTS_HARNESS_STATUS_ASSERT_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace optimus {
namespace harness {
namespace internal {
inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace internal
}  // namespace harness
}  // namespace optimus

// The expression's status must be OK; the message shows the expression and
// the status otherwise.
#define ASSERT_OK(expr)                                                            \
  do {                                                                             \
    const auto& _optimus_st = (expr);                                              \
    ASSERT_TRUE(::optimus::harness::internal::StatusOf(_optimus_st).ok())          \
        << #expr << ": " << ::optimus::harness::internal::StatusOf(_optimus_st);   \
  } while (false)

#define EXPECT_OK(expr)                                                            \
  do {                                                                             \
    const auto& _optimus_st = (expr);                                              \
    EXPECT_TRUE(::optimus::harness::internal::StatusOf(_optimus_st).ok())          \
        << #expr << ": " << ::optimus::harness::internal::StatusOf(_optimus_st);   \
  } while (false)

// `lhs = *expr` when expr (an absl::StatusOr) is OK; a fatal failure
// otherwise. lhs may declare a variable: ASSERT_OK_AND_ASSIGN(auto v, F());
#define OPTIMUS_STATUS_CONCAT_INNER(a, b) a##b
#define OPTIMUS_STATUS_CONCAT(a, b) OPTIMUS_STATUS_CONCAT_INNER(a, b)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(OPTIMUS_STATUS_CONCAT(_optimus_statusor_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)                   \
  auto tmp = (expr);                                                \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status();           \
  lhs = std::move(*tmp)

#endif  // OPTIMUS_TESTS_HARNESS_STATUS_ASSERT_H_
