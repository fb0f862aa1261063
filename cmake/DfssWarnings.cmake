# dfss_target_warnings(<target>): the project's warning set, target-scoped; -Werror with DFSS_WERROR.
# -Wnull-dereference is left out: with GCC 12 at -O2 it fires on libstdc++ code inlined into ours
# (vector::insert, std::string in CLI11), false positives that -Werror would turn into build breaks.
# Sanitizers (DFSS_SANITIZE) are applied to every target of the build so that libraries, tests and
# tools agree on the runtime.
function(dfss_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
      -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Wunused -Woverloaded-virtual
      -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough>)
  if(DFSS_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

if(DFSS_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${DFSS_SANITIZE}>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=all>)
  add_link_options(-fsanitize=${DFSS_SANITIZE})
endif()
