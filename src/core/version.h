// What this binary is: the project version (NIBBLE_VERSION, from CMake) and the commit it was
// built from (`git describe --dirty` at build time; "unknown" outside a git checkout).
#pragma once

namespace nibble {

const char* git_commit();

}  // namespace nibble
