# consumer_cli_demo: the installed `dfss demo` finds the installed real-attention data
# (share/dfss/text-lm-qkv, looked up relative to the executable), not the source tree's copy.
# Usage: cmake -DDFSS=<prefix>/bin/dfss -DDATA=<prefix>/share/dfss/text-lm-qkv -P check_cli_demo.cmake
execute_process(COMMAND ${DFSS} demo --seq-len 16 --heads 1 --head-dim 8 --threads 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${DFSS} demo: exit code ${rc}\n${out}\n${err}")
endif()
file(REAL_PATH "${DATA}" data)
string(FIND "${out}" "data: ${data} (2 inputs, causal;" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${DFSS} demo: expected its real rows to read ${data}; it printed:\n${out}\n${err}")
endif()
foreach(row "layer0       2:4" "layer3       1:2")
  string(FIND "${out}" "${row}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${DFSS} demo: no row '${row}' in:\n${out}")
  endif()
endforeach()
