# Two helpers, in the manner of absl_cc_library / absl_cc_test: every module is
# one library target, every test one Catch2 binary registered with ctest.

set(FULCRUM_WARNINGS -Wall -Wextra -Werror)
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  list(APPEND FULCRUM_WARNINGS -Wthread-safety)
elseif(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12 at -O3 (CMAKE_BUILD_TYPE=Release) reports -Wrestrict inside
  # std::string::assign, a libstdc++ false positive (GCC bug 105329) at every
  # string assignment from a literal: off for GCC 12, on for later ones.
  if(CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    list(APPEND FULCRUM_WARNINGS -Wno-restrict)
  endif()
endif()

# fulcrum_cc_library(NAME name SRCS ... DEPS ... [COPTS ...])
function(fulcrum_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS;COPTS" ${ARGN})
  add_library(${ARG_NAME} STATIC ${ARG_SRCS})
  target_include_directories(${ARG_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(${ARG_NAME} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${FULCRUM_WARNINGS} ${ARG_COPTS}>)
  target_link_libraries(${ARG_NAME} PUBLIC ${ARG_DEPS})
endfunction()

# The libraries `target` links, directly or through others (targets only).
function(fulcrum_link_closure target out)
  set(seen "")
  set(todo ${target})
  while(todo)
    list(POP_FRONT todo t)
    if(NOT TARGET ${t} OR t IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${t})
    get_target_property(type ${t} TYPE)
    set(deps "")
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${t} LINK_LIBRARIES)
      if(direct)
        list(APPEND deps ${direct})
      endif()
    endif()
    get_target_property(iface ${t} INTERFACE_LINK_LIBRARIES)
    if(iface)
      list(APPEND deps ${iface})
    endif()
    list(APPEND todo ${deps})
  endwhile()
  list(REMOVE_ITEM seen ${target})
  set(${out} ${seen} PARENT_SCOPE)
endfunction()

# The layering rule (docs/architecture.md): configuration fails, naming
# the path's end, when `target` links any of FORBID.
#   fulcrum_forbid_links(TARGET fulcrum-worker FORBID fulcrum_server ...)
function(fulcrum_forbid_links)
  cmake_parse_arguments(ARG "" "TARGET" "FORBID" ${ARGN})
  fulcrum_link_closure(${ARG_TARGET} closure)
  foreach(f ${ARG_FORBID})
    if(f IN_LIST closure)
      message(FATAL_ERROR "${ARG_TARGET} links ${f}, which the layering rule forbids (docs/architecture.md)")
    endif()
  endforeach()
endfunction()

# The same rule at the source: configuration fails, naming the file and
# line, when any of FILES has a line matching REGEX.
#   fulcrum_forbid_includes(FILES a.cc a.h REGEX "#include <grpc" WHY "...")
function(fulcrum_forbid_includes)
  cmake_parse_arguments(ARG "" "REGEX;WHY" "FILES" ${ARGN})
  foreach(f ${ARG_FILES})
    file(STRINGS ${f} bad REGEX "${ARG_REGEX}")
    if(bad)
      message(FATAL_ERROR "${f}: ${bad}: ${ARG_WHY}")
    endif()
  endforeach()
endfunction()

# fulcrum_cc_test(NAME name SRCS ... DEPS ... [LABELS ...] [DATA] [GPU])
#   DATA: the test reads real datasets; ctest fetches them first (fixture
#         fulcrum_data, deploy/local/fetch_data.sh into FULCRUM_TEST_DATA_DIR).
#   GPU:  test cases print "SKIPPED: no GPU" where there is none; ctest then
#         reports them as skipped, with that line as the reason.
function(fulcrum_cc_test)
  cmake_parse_arguments(ARG "DATA;GPU" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  # ctest splits discovered test names at ';' (a CMake list separator), and
  # the halves then "pass" without running anything: refuse such names.
  foreach(src ${ARG_SRCS})
    file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/${src} bad REGEX "(TEST_CASE\\(\"[^\"]*;)|(^ +\"[^\"]*;[^\"]*\",)")
    if(bad)
      message(FATAL_ERROR "${src}: a TEST_CASE name contains ';', which ctest cannot run: ${bad}")
    endif()
  endforeach()
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_compile_options(${ARG_NAME} PRIVATE ${FULCRUM_WARNINGS})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} fulcrum_testing Catch2::Catch2WithMain)
  target_compile_definitions(${ARG_NAME} PRIVATE FULCRUM_TEST_DATA_DIR="${FULCRUM_TEST_DATA_DIR}")
  set(props TIMEOUT 300)
  if(ARG_LABELS)
    list(APPEND props LABELS "${ARG_LABELS}")
  endif()
  if(ARG_DATA)
    list(APPEND props FIXTURES_REQUIRED fulcrum_data)
  endif()
  if(ARG_GPU)
    list(APPEND props SKIP_REGULAR_EXPRESSION "SKIPPED: no GPU")
  endif()
  # -w NoTests: a name ctest could not pass through intact matches no test,
  # and that must fail, not pass silently.
  catch_discover_tests(${ARG_NAME} TEST_PREFIX "${ARG_NAME}: " EXTRA_ARGS -w NoTests PROPERTIES ${props})
endfunction()
