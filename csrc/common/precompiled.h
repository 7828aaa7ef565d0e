// The torch headers most of tp_ext's C++ files include, compiled once per build into a
// precompiled header (setup.py, TP_EXT_PCH): parsing them is about 20 s of each file's 25 to 40 s
// on one core. Only a build-speed device: every file still includes what it uses, the build
// works without it (TP_EXT_PCH=0), and the .cu files never see it.
// An include guard, not #pragma once: GCC warns about the pragma in the file it precompiles.
#ifndef TP_EXT_COMMON_PRECOMPILED_H_
#define TP_EXT_COMMON_PRECOMPILED_H_

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#endif  // TP_EXT_COMMON_PRECOMPILED_H_
