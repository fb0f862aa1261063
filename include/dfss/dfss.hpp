// dfss/dfss.hpp: umbrella header of the dfss public API.
#pragma once

#include "dfss/attention.hpp"
#include "dfss/build_info.hpp"
#include "dfss/config.hpp"
#include "dfss/error.hpp"
#include "dfss/format.hpp"
#include "dfss/merge.hpp"
#include "dfss/numeric.hpp"
#include "dfss/params.hpp"
#include "dfss/tensor.hpp"
#include "dfss/types.hpp"
