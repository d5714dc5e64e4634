// Sealed objects (io/sealed_object.h): the payload comes back only under the same secret and
// the same name, and any changed byte, a truncation or another format is refused.
#include <pulseloco/io/sealed_object.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <pulseloco/base/errors.h>

namespace pulseloco::io {
namespace {

std::vector<std::byte> bytes_of(const std::string& text) {
  const auto* data = reinterpret_cast<const std::byte*>(text.data());
  return {data, data + text.size()};
}

TEST(SealedObject, OpensUnderTheSameSecretAndName) {
  const auto payload = bytes_of("window message");
  const auto sealed = seal_object("secret", "prefix/job/w1/c3-r2", payload);
  EXPECT_EQ(sealed.size(), payload.size() + kSealOverhead);
  const auto opened = open_sealed_object("secret", "prefix/job/w1/c3-r2", sealed);
  ASSERT_TRUE(opened.has_value());
  EXPECT_EQ(std::vector<std::byte>(opened->begin(), opened->end()), payload);
  const auto empty = seal_object("secret", "name", {});
  EXPECT_TRUE(open_sealed_object("secret", "name", empty).has_value());
}

TEST(SealedObject, AnotherSecretNameOrAnyChangedByteIsRefused) {
  const auto sealed = seal_object("secret", "job/w1/c3-r2", bytes_of("window message"));
  EXPECT_FALSE(open_sealed_object("other secret", "job/w1/c3-r2", sealed).has_value());
  EXPECT_FALSE(open_sealed_object("secret", "job/w2/c3-r2", sealed).has_value());
  EXPECT_FALSE(open_sealed_object("secret", "job/w1/c3-r1", sealed).has_value());
  EXPECT_FALSE(open_sealed_object("", "job/w1/c3-r2", sealed).has_value());
  for (std::size_t i = 0; i < sealed.size(); ++i) {
    auto changed = sealed;
    changed[i] ^= std::byte{1};
    EXPECT_FALSE(open_sealed_object("secret", "job/w1/c3-r2", changed).has_value()) << i;
  }
  EXPECT_FALSE(
      open_sealed_object("secret", "job/w1/c3-r2", std::span(sealed).first(sealed.size() - 1))
          .has_value());
  EXPECT_FALSE(open_sealed_object("secret", "job/w1/c3-r2", std::span(sealed).first(10)));
}

TEST(SealedObject, AnEmptySecretIsRefused) {
  EXPECT_THROW((void)seal_object("", "name", bytes_of("x")), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco::io
