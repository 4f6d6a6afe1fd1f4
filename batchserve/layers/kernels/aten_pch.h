// The torch headers the kernel files share, compiled once per build into a precompiled header (build.py compiles
// aten_pch.h.gch with the very flags the build tool compiles the sources with). A file that includes ATen includes
// this first, before any other line that is not a comment: the compiler takes a precompiled header only as a file's
// first include, and parses these headers as text otherwise (the same declarations, 7 s more per file). No
// `#pragma once`: the file is compiled as a header of its own, where that is a warning, and what it includes is guarded.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
